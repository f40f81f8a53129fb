"""What `LoadSide` adds for restores read in place into vLLM's host blocks
(``worker.py``'s overview, "On the host path a synchronous restore ..."):
which loads read in place, vLLM's cache registered for them, and the waits
for reads that cannot be revoked before vLLM hears of a load (`_hand_back`
on vLLM's thread, `_reads_ended` on the loop). The reads themselves are
`StagedLoad`'s in-place reads into a `BlockPlacement` (``objects.py``); the
load's `Gate` counts them in flight.
"""

from __future__ import annotations

from collections import Counter

from layerlift.engine.threads import run_owned
from layerlift.hosts.vllm.worker_base import WorkerBase, _Load, log
from layerlift.hosts.vllm.worker_held import IN_PLACE_BYTES

__all__ = ["IN_PLACE_ROWS", "BlocksStillWritten", "InPlaceRestores"]

# An in-place restore reads a layer in one store call, a range a block (and
# one for its footer, with the first layer): at most this many blocks a
# group, so a call stays within 256 ranges, the in-place puts' bound
# (Mooncake's TCP transport queues 1024 transfers a peer; up to four such
# calls run at once). Larger restores, and blocks under `IN_PLACE_BYTES` a
# layer (the store's per-range cost outweighs the copy), go through staging.
IN_PLACE_ROWS = 128


class BlocksStillWritten(RuntimeError):
    """A store read into vLLM's blocks (an in-place restore that failed or
    timed out) did not end within ``read_end_s``: the worker cannot hand the
    blocks back to vLLM (it would recompute into them while the read may
    still write them), so it stops the step with this error instead."""


class InPlaceRestores(WorkerBase):
    """The in-place restores' rules and waits (see the module docstring)."""

    def _reads_in_place(self, load: _Load) -> bool:
        """Whether ``load`` reads straight into vLLM's blocks: a synchronous
        load (the forward waits layer by layer: one call a layer either way)
        on the host path (every layer of its groups a `HostBlocks` table),
        blocks of at least `IN_PLACE_BYTES` a layer, at most `IN_PLACE_ROWS`
        blocks a group. An asynchronous load stays staged (`StagedLoad.fetch_all`:
        chunks across layers, four at once; one call for a small load): read
        in place, one call a layer, it moved 0.89 (0.76-0.99 per round) of
        the staged restore over a 10 Gbit link, inside the spread of two
        identical staged restores (0.88-1.03 medians; ``bench transfer-vllm
        --with-staged``, docs/guide/benchmarks.md): no gain to show."""
        if not self._in_place_restores or not load.items or not load.spec.sync:
            return False
        for g, n in Counter(g for g, _, _ in load.items).items():
            if n > IN_PLACE_ROWS:
                return False
            for name in self._groups[g].layer_names:
                if self._host_blocks.get(name) is None or \
                        self.layout.layer_bytes[name] < IN_PLACE_BYTES:
                    return False
        return True

    async def _cache_ready(self) -> bool:
        """The loop: vLLM's cache registered with the store (once); False,
        and no in-place restore from now on, when that failed."""
        if self._cache_registered is not None:
            return True
        try:
            await run_owned(self._register_cache)
        except Exception as exc:  # any refusal: the staged path needs no registration
            log.warning("LayerLift: registering vLLM's cache for in-place restores failed "
                        "(%s); restores go through staging", exc)
            self._in_place_restores = False
            return False
        return True

    def _hand_back(self, load: _Load) -> None:
        """vLLM's thread, before it hears of a synchronous load: wait until
        no read of it still writes vLLM's blocks (an in-place load; at most
        ``read_end_s``, else `BlocksStillWritten`)."""
        if load.in_place and not load.gate.wait_reads(self.read_end_s):
            raise BlocksStillWritten(
                f"LayerLift: a store read into vLLM's blocks for request {load.spec.req_id} "
                f"did not end within {self.read_end_s:g} s; the blocks cannot be handed back "
                "to vLLM while it may still write them (is the storage node reachable?)")

    async def _reads_ended(self, load: _Load) -> None:
        """The loop: wait (off it, at most ``read_end_s``) until no read of
        an in-place load is in flight; one still running then keeps vLLM's
        cache registered (`_reading`) until it ended."""
        gate = load.gate
        if gate.reads and not await run_owned(lambda: gate.wait_reads(self.read_end_s)):
            log.error("LayerLift: a store read into vLLM's blocks for %s has not ended after "
                      "%.0f s; it is not reported to vLLM until it did", load.spec.req_id,
                      self.read_end_s)
            with self._lock:
                self._reading.add(id(load))

            def ended() -> None:
                with self._lock:
                    self._reading.discard(id(load))

            gate.when_quiet(ended)
