"""A stand-in for SGLang's scheduler around one real ``UnifiedRadixCache`` on CPU.

For the ``sglang`` tests and ``layerlift bench sglang`` (and a user's own
checks): it builds SGLang 0.5.23's real pools for a FULL + SWA + MAMBA layout
(``SWAKVPool`` over two ``MHATokenToKVPool``, ``SWATokenToKVPoolAllocator``,
``HybridReqToTokenPool`` with its ``MambaPool``), a real ``UnifiedRadixCache``,
a linker made by SGLang's own ``create_unified_cache_linker`` and attached as
SGLang's ``registry.py`` attaches it, then makes the calls SGLang's scheduler
makes: ``Req.init_next_round_input`` (match, with the linker's lookup),
``init_load_back``, ``ready_to_load_host_cache``, ``set_consumer``, a forward
stand-in that reads each layer through the pools' own accessors (which wait
on the linker's counter), ``finish_external_linker_loads``, ``insert``
(which queues offloads) and ``check_hicache_events`` (completions).

Its "model" writes bytes that depend on the whole prefix (a page's KV from the
tokens up to its end, a Mamba state from the tokens up to its boundary), so
two caches that computed the same prefix hold the same bytes. Not used by the
linker itself.

Its byte work (the model's writes, the forward's reads, ``expected``) runs in
numpy on raw 64-bit words, one vectorised call per layer: torch's intra-op
threads collapse on a busy 2-core machine (its float ``rand`` took 20 ms per
128 KiB page under load, a 1 GiB prompt minutes), numpy's single-threaded
copies do not.
"""

from __future__ import annotations

import hashlib
import math
import sys
import time
from array import array
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

__all__ = ["Admission", "HybridShape", "Restore", "SGLangHost", "is_zero", "model_bytes",
           "model_states", "prefix_digests", "put_rows", "same_bytes", "take_rows"]


@dataclass(frozen=True, slots=True)
class HybridShape:
    """The cache's layout: layer kinds ("F" full, "S" sliding, "M" mamba) in model order."""

    kinds: str = "FSMSMF"
    page_size: int = 16
    window: int = 32
    head_num: int = 2
    head_dim: int = 16
    kv_tokens: int = 4096
    mamba_slots: int = 24
    chunked_prefill_size: int | None = None

    def layers(self, kind: str) -> list[int]:
        return [i for i, k in enumerate(self.kinds) if k == kind]


def prefix_digests(tokens: list[int], ends: Sequence[int]) -> list[int]:
    """A 64-bit digest of ``tokens[:end]`` for each of ``ends`` (ascending), in
    one pass over the tokens (BLAKE2b streams: a digest after ``update`` of the
    pieces is the digest of the whole prefix)."""
    h = hashlib.blake2b(digest_size=8)
    out, at = [], 0
    for end in ends:
        if end < at:
            raise ValueError(f"prefix ends must ascend; {end} follows {at}")
        h.update(array("q", tokens[at:end]).tobytes())
        at = end
        out.append(int.from_bytes(h.copy().digest(), "little"))
    return out


_MASK64 = (1 << 64) - 1


def _stream_key(digest: int, stream: int) -> int:
    """SplitMix64's finaliser over (prefix digest, stream): one key per state."""
    z = (digest ^ ((stream + 1) * 0x9E3779B97F4A7C15)) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return z ^ (z >> 31)


def _finite_mask(dtype: torch.dtype) -> int:
    """A 64-bit word mask that clears the top exponent bit of each element of a
    floating ``dtype`` (so no element is an infinity or a NaN: ``torch.equal``
    of equal bytes is then True); all ones for other dtypes."""
    size = dtype.itemsize
    if not dtype.is_floating_point or 8 % size:
        return _MASK64
    element = ((1 << (8 * size)) - 1) & ~(1 << (8 * size - 2))
    return int.from_bytes(element.to_bytes(size, sys.byteorder) * (8 // size), sys.byteorder)


def model_states(digests: Sequence[int], stream: int, shape: tuple[int, ...],
                 dtype: torch.dtype) -> torch.Tensor:
    """The harness model's states of ``shape`` after each prefix of ``digests``
    (:func:`prefix_digests`) in ``stream`` (a layer's K, V or state tensor):
    ``[len(digests), *shape]``. Word ``w`` of a state is ``base[w] ^ (key *
    mult[w])`` with ``base`` and odd ``mult`` random per stream and ``key`` per
    (prefix, stream): words differ within a state, and every word differs
    between two prefixes (an odd multiplier is a bijection mod 2**64)."""
    nbytes = math.prod(shape) * dtype.itemsize
    words = -(-nbytes // 8)
    rng = np.random.Generator(np.random.PCG64([stream, nbytes]))
    base = np.frombuffer(rng.bytes(8 * words), dtype=np.uint64)
    mult = np.frombuffer(rng.bytes(8 * words), dtype=np.uint64) | np.uint64(1)
    keys = np.array([_stream_key(d, stream) for d in digests], dtype=np.uint64)
    out = np.multiply(keys[:, None], mult[None, :])
    out ^= base
    out &= np.uint64(_finite_mask(dtype))
    raw = np.ascontiguousarray(out.view(np.uint8)[:, :nbytes])
    return torch.from_numpy(raw).view(dtype).reshape(len(digests), *shape)


def model_bytes(tokens: list[int], layer: int, shape: tuple[int, ...],
                dtype: torch.dtype) -> torch.Tensor:
    """The harness model's state after ``tokens`` at ``layer`` (a stream of
    :func:`model_states`): equal prefixes give equal bytes and others differ."""
    return model_states(prefix_digests(tokens, [len(tokens)]), layer, shape, dtype)[0]


def _words(t: torch.Tensor) -> np.ndarray:
    """``t``'s rows as a 2-D numpy view of its raw bytes, as 64-bit words where
    a row holds whole words (a CPU tensor, contiguous)."""
    if t.device.type != "cpu" or not t.is_contiguous():
        raise ValueError("the harness reads and writes contiguous CPU tensors only")
    rows = int(t.shape[0]) if t.dim() and t.shape[0] else 1
    flat = t.reshape(-1).view(torch.uint8).numpy().reshape(rows, -1)
    return flat.view(np.uint64) if flat.shape[1] % 8 == 0 else flat


def take_rows(t: torch.Tensor, rows: torch.Tensor, out: torch.Tensor | None = None
              ) -> torch.Tensor:
    """A copy of ``t[rows]`` (the same bytes, dtype and shape), gathered by
    numpy; into ``out`` (returned) when given, which must have that dtype
    and shape and be contiguous. ``IndexError`` for a row outside ``t``."""
    idx = rows.numpy()
    if out is None:
        got = _words(t)[idx].view(np.uint8)
        return torch.from_numpy(got).view(t.dtype).reshape(len(rows), *t.shape[1:])
    if out.dtype != t.dtype or tuple(out.shape) != (len(rows), *t.shape[1:]):
        raise ValueError(f"rows of {t.dtype} {tuple(t.shape)} do not fit {out.dtype} "
                         f"{tuple(out.shape)}")
    if len(idx) and (int(idx.min()) < 0 or int(idx.max()) >= t.shape[0]):
        raise IndexError(f"rows {int(idx.min())}..{int(idx.max())} outside {t.shape[0]} rows")
    np.take(_words(t), idx, axis=0, out=_words(out), mode="clip")  # bounds checked above
    return out


def put_rows(t: torch.Tensor, rows: torch.Tensor, values: torch.Tensor) -> None:
    """``t[rows] = values`` (``values`` of ``t``'s dtype and row shape), by numpy."""
    if values.dtype != t.dtype or tuple(values.shape) != (len(rows), *t.shape[1:]):
        raise ValueError(f"{values.dtype} {tuple(values.shape)} does not fit rows of {t.dtype} "
                         f"{tuple(t.shape)}")
    _words(t)[rows.numpy()] = _words(values)


def same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    """``a`` and ``b`` have the same dtype, shape and bytes: byte identity, not
    ``torch.equal``'s comparison of values (there ``-0.0`` equals ``0.0``)."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    return a.numel() == 0 or bool(np.array_equal(_words(a.contiguous()), _words(b.contiguous())))


def is_zero(t: torch.Tensor) -> bool:
    """Every byte of ``t`` is zero."""
    return t.numel() == 0 or not bool(_words(t.contiguous()).any())


@dataclass
class Admission:
    """One request admitted into the batch being built (``SGLangHost.admit``)."""

    tokens: list[int]
    req: Any
    restore: Restore
    aborted: bool = False
    done: bool = False  # released (nothing to load, aborted before start, or finished)
    device_prefix: int = 0  # tokens the device tree held before the load
    admitted: bool = True  # PrefillAdder took it (admit_batch)
    chunked: bool = False  # PrefillAdder took it as the batch's chunked request


@dataclass
class Restore:
    """What one restore through the linker gave."""

    rid: str
    hit_tokens: int  # host_hit_length reported by match
    loaded_tokens: int  # what init_load_back queued
    ok: bool  # finish_external_linker_loads did not fail the request
    layers: dict[int, list[torch.Tensor]] = field(default_factory=dict)  # bytes the forward read
    wait_s: list[float] = field(default_factory=list)  # per layer: when its wait returned
    forward_s: float = 0.0
    settled_s: float = 0.0  # from the start of the load to finish's verdict
    tail: torch.Tensor | None = None  # the request's loaded FULL slots
    mamba_slot: int | None = None


class SGLangHost:
    """One SGLang cache with a linker from ``create_unified_cache_linker``."""

    def __init__(self, shape: HybridShape, *, backend: str, config: dict[str, Any] | None,
                 model_path: str = "dummy", server_args_extra: dict[str, Any] | None = None,
                 req_pool_extra: dict[str, Any] | None = None,
                 params_extra: dict[str, Any] | None = None,
                 parallel: dict[str, int] | None = None, reuse_reads: bool = False) -> None:
        """``server_args_extra``, ``req_pool_extra``, ``params_extra``: more
        arguments of SGLang's ``ServerArgs``, ``HybridReqToTokenPool`` and
        ``CacheInitParams`` (features a test turns on). ``parallel``: the
        parallel layout this rank sees while its linker is built (SGLang's
        ``get_parallel().override``, e.g. ``tp_size``, ``attn_tp_rank``).
        ``reuse_reads`` (a benchmark's consumer): the forward copies each
        layer's K and V rows into buffers kept from one restore to the next,
        so a ``Restore.layers`` is valid only until the next forward; without
        it every forward copies into new memory (a test may keep restores
        side by side). A real layout's forward reads 1 GiB: into new memory
        that is 1 GiB of first touches, which on the 2-core VM sometimes cost
        70 ms a 32 MiB layer of kernel time (the VM backing freed memory
        again), for either linker, at random."""
        from sglang.srt.configs.mamba_utils import (
            Mamba2CacheParams,
            Mamba2StateDType,
            Mamba2StateShape,
        )
        from sglang.srt.mem_cache.allocator.swa import SWATokenToKVPoolAllocator
        from sglang.srt.mem_cache.cache_init_params import CacheInitParams
        from sglang.srt.mem_cache.memory_pool import HybridReqToTokenPool
        from sglang.srt.mem_cache.swa_memory_pool import SWAKVPool
        from sglang.srt.mem_cache.unified_cache.components import ComponentType
        from sglang.srt.mem_cache.unified_cache.linker_factory import create_unified_cache_linker
        from sglang.srt.mem_cache.unified_radix_cache import UnifiedRadixCache
        from sglang.srt.runtime_context import get_parallel, publish
        from sglang.srt.server_args import ServerArgs

        self.shape = s = shape
        self.reuse_reads = reuse_reads
        self._read_buffers: dict[tuple[int, int], torch.Tensor] = {}
        self.server_args = ServerArgs(model_path=model_path, page_size=s.page_size,
                                      mamba_radix_cache_strategy="extra_buffer",
                                      **(server_args_extra or {}))
        self.server_args._mamba_cache_chunk_size = s.page_size
        publish(self.server_args, role="scheduler")
        state = Mamba2StateShape.create(tp_world_size=1, intermediate_size=16, n_groups=1,
                                        num_heads=1, head_dim=16, state_size=2, conv_kernel=4)
        mamba_ids = s.layers("M")
        self.req_pool = HybridReqToTokenPool(
            size=8, mamba_size=s.mamba_slots, mamba_spec_state_size=8, max_context_len=s.kv_tokens,
            device="cpu", enable_memory_saver=False, mamba_layer_ids=mamba_ids,
            cache_params=Mamba2CacheParams(shape=state, layers=mamba_ids, dtype=Mamba2StateDType(
                conv=torch.float32, temporal=torch.float32)),
            enable_mamba_extra_buffer=True, **(req_pool_extra or {}))
        self.kv = SWAKVPool(size=s.kv_tokens, size_swa=s.kv_tokens, page_size=s.page_size,
                            dtype=torch.bfloat16, head_num=s.head_num, head_dim=s.head_dim,
                            swa_attention_layer_ids=s.layers("S"),
                            full_attention_layer_ids=s.layers("F"), device="cpu")
        self.alloc = SWATokenToKVPoolAllocator(
            size=s.kv_tokens, size_swa=s.kv_tokens, page_size=s.page_size, dtype=torch.bfloat16,
            device="cpu", kvcache=self.kv, need_sort=False)
        self.params = CacheInitParams(
            disable=False, req_to_token_pool=self.req_pool, token_to_kv_pool_allocator=self.alloc,
            page_size=s.page_size, sliding_window_size=s.window, enable_mamba_extra_buffer=True,
            tree_components=(ComponentType.FULL, ComponentType.SWA, ComponentType.MAMBA),
            chunked_prefill_size=s.chunked_prefill_size, **(params_extra or {}))
        self.cache = UnifiedRadixCache(self.params)
        # As sglang/srt/mem_cache/registry.py attaches a linker:
        with get_parallel().override(**(parallel or {})):
            self.linker = create_unified_cache_linker(
                self.server_args, self.params, backend=backend, config=config,
                components=set(self.cache.components), forward_stream=None)
        self.cache.init_cache_linker(self.linker)
        self.kv.register_layer_transfer_counter(self.linker.layer_done_counter)
        self._rid = 0
        self._started = 0.0
        # When compute() began its inserts: ``clock()``'s reading then (by
        # default (wall, CPU)); a transfer benchmark times offloads from it
        # and sets ``clock`` to its own (which reads the machine's counters too).
        self.clock: Callable[[], Any] = lambda: (time.perf_counter(), time.process_time())
        self.insert_clock: Any = (0.0, 0.0)

    # ---- the producer side: compute, insert, offload ------------------------------

    def _req(self, tokens: list[int]) -> Any:
        from sglang.srt.managers.schedule_batch import Req
        from sglang.srt.sampling.sampling_params import SamplingParams

        sampling = SamplingParams(max_new_tokens=1)
        sampling.normalize(None)
        self._rid += 1
        return Req(rid=f"r{self._rid}", origin_input_text="", vocab_size=1 << 20,
                   origin_input_ids=array("q", tokens), sampling_params=sampling)

    def _write_kv(self, tokens: list[int], slots: torch.Tensor, start: int) -> None:
        """The model's KV for pages ``[start, len)`` into every attention layer."""
        p = self.shape.page_size
        first, last = start // p, len(tokens) // p
        if first >= last:
            return
        digests = prefix_digests(tokens, [(q + 1) * p for q in range(first, last)])
        swa_slots = self.alloc.translate_loc_from_full_to_swa(slots)
        for layer in [*self.shape.layers("F"), *self.shape.layers("S")]:
            idx, is_swa = self.kv.layers_mapping[layer]
            pool = self.kv.swa_kv_pool if is_swa else self.kv.full_kv_pool
            at = (swa_slots if is_swa else slots)[first * p:last * p]
            for h, buf in enumerate((pool.k_buffer[idx], pool.v_buffer[idx])):
                pages = model_states(digests, 2 * layer + h, (p, *buf.shape[1:]), buf.dtype)
                put_rows(buf, at, pages.reshape(-1, *buf.shape[1:]))

    def _write_mamba(self, tokens: list[int], slot: int) -> None:
        cache = self.req_pool.mamba_pool.mamba_cache
        for layer, i in self.req_pool.mamba_map.items():
            for n, state in enumerate((cache.temporal, *cache.conv)):
                state[i, slot] = model_bytes(tokens, 100 * layer + n, tuple(state.shape[2:]),
                                             state.dtype)

    def compute(self, tokens: list[int], checkpoints: list[int]) -> None:
        """Prefill ``tokens`` as the model would (the device prefix the tree
        already holds is reused) and insert it, with a Mamba checkpoint at each
        of ``checkpoints`` (token counts, page multiples; the last is usually
        ``len(tokens)``). The inserts queue the linker's offloads."""
        from sglang.srt.mem_cache.base_prefix_cache import InsertParams, MatchPrefixParams
        from sglang.srt.mem_cache.radix_cache import RadixKey

        key = RadixKey(array("q", tokens))
        match = self.cache.match_prefix(MatchPrefixParams(key=key))
        d = match.device_prefix_len
        prefix = self.cache.tree_core.collect_full_device_indices(
            match.last_device_node, self.cache.root_node_handle())[:d]
        n = len(tokens)
        new = self.alloc.alloc_extend(
            torch.tensor([d]), torch.tensor([d]), torch.tensor([n]), torch.tensor([n]),
            torch.tensor([int(prefix[-1]) if d else -1]), n - d)
        if new is None:
            raise RuntimeError("the harness cache is full")
        value = torch.cat([prefix.to(torch.int64), new.to(torch.int64)])
        self._write_kv(tokens, value, d)
        protected = d  # what the tree already holds of this request (not to be freed)
        self.insert_clock = self.clock()  # offloads may start now
        for c in sorted(checkpoints):
            slot = self.req_pool.mamba_allocator.alloc(1)
            if slot is None:
                raise RuntimeError("the harness has no Mamba slot left")
            self._write_mamba(tokens[:c], int(slot[0]))
            result = self.cache.insert(InsertParams(
                key=RadixKey(array("q", tokens[:c])), value=value[:c], mamba_value=slot,
                prev_prefix_len=protected))
            protected = c
            if result.mamba_exist:
                self.req_pool.mamba_allocator.free(slot)

    def settle_offloads(self, timeout_s: float = 30.0) -> int:
        """Poll completions as the scheduler does each step, until no offload
        is pending; returns how many were committed. RuntimeError past ``timeout_s``."""
        wrapper = self.cache.linker
        total = len(wrapper.pending_offloads)
        deadline = time.monotonic() + timeout_s
        while wrapper.pending_offloads:
            self.cache.check_hicache_events()
            if time.monotonic() > deadline:
                raise RuntimeError(f"{len(wrapper.pending_offloads)} offload(s) still pending")
            time.sleep(0.002)
        return total

    # ---- the consumer side: match, load back, forward, finish ---------------------

    def forward(self, adm: Admission, compute_s: float = 0.0, read: bool = True) -> None:
        """The forward stand-in for one request of the batch: layer by layer,
        call the pools' accessors (each waits on the linker's counter), copy
        the request's loaded slots into ``Restore.layers`` (unless ``read`` is
        False: a transfer benchmark checks them after the load), then spend
        ``compute_s`` as the layer's compute (a sleep: it uses no CPU)."""
        if adm.done:
            return
        req, restore, tail = adm.req, adm.restore, adm.restore.tail
        assert tail is not None
        started = time.perf_counter()
        slot = int(req.kv.mamba_pool_idx)
        for layer, kind in enumerate(self.shape.kinds):
            if kind == "M":
                self.req_pool.mamba2_layer_cache(layer)  # waits for the layer
            else:
                self.kv.get_key_buffer(layer)
                self.kv.get_value_buffer(layer)
            restore.wait_s.append(time.perf_counter() - started)
            if read:
                restore.layers[layer] = self.loaded_layer(tail, slot, layer)
            if compute_s > 0:
                time.sleep(compute_s)
        restore.forward_s = time.perf_counter() - started

    def loaded_layer(self, tail: torch.Tensor, mamba_slot: int, layer: int) -> list[torch.Tensor]:
        """A copy of what a request's forward reads of ``layer``: the K and V
        rows of its loaded slots ``tail`` (a sliding-window layer's last
        window of them; into this host's kept buffers with ``reuse_reads``),
        or a Mamba layer's states in ``mamba_slot``. Reads
        the pools directly: call it once the layer's wait returned."""
        if self.shape.kinds[layer] == "M":
            idx = self.req_pool.mamba_map[layer]
            cache = self.req_pool.mamba_pool.mamba_cache
            return [s[idx, mamba_slot].clone() for s in (cache.temporal, *cache.conv)]
        idx, is_swa = self.kv.layers_mapping[layer]
        pool = self.kv.swa_kv_pool if is_swa else self.kv.full_kv_pool
        rows = tail
        if is_swa:
            w_pages = -(-self.shape.window // self.shape.page_size) * self.shape.page_size
            rows = self.alloc.translate_loc_from_full_to_swa(tail)[-w_pages:]
        return [take_rows(buf, rows, self._read_buffer(layer, h, buf, len(rows)))
                for h, buf in enumerate((pool.k_buffer[idx], pool.v_buffer[idx]))]

    def _read_buffer(self, layer: int, half: int, pool: torch.Tensor,
                     rows: int) -> torch.Tensor | None:
        """Where the forward copies ``rows`` rows of ``layer``'s K (``half``
        0) or V (1): None (new memory) unless ``reuse_reads``; else this
        host's buffer for them, made again when the row count changed."""
        if not self.reuse_reads:
            return None
        shape = (rows, *pool.shape[1:])
        buf = self._read_buffers.get((layer, half))
        if buf is None or buf.dtype != pool.dtype or tuple(buf.shape) != shape:
            buf = self._read_buffers[(layer, half)] = torch.empty(shape, dtype=pool.dtype)
        return buf

    def admit(self, tokens: list[int]) -> Admission:
        """Admit one request for ``tokens`` (the last token is the one to
        compute) as SGLang's scheduler does before a batch starts: a request
        row, ``Req.init_next_round_input`` (match, with the linker's lookup),
        ``init_load_back`` (the linker's ``load``). A request with nothing
        to load is released at once (``Admission.restore.loaded_tokens == 0``)."""
        from sglang.srt.mem_cache.base_prefix_cache import InitLoadBackParams

        req = self._req(tokens)
        self.req_pool.alloc([req])
        req.init_next_round_input(self.cache)
        hit = int(req.host_hit_length)
        loaded, req.last_node = self.cache.init_load_back(InitLoadBackParams(
            best_match_node=req.best_match_node, host_hit_length=hit, req=req))
        restore = Restore(req.rid, hit, int(loaded), ok=False)
        adm = Admission(tokens, req, restore, device_prefix=int(req.prefix_len))
        if not loaded:
            self._release(req, None)
            adm.done = True
            return adm
        restore.tail = self.cache.linker.private_load_indices[req.rid].clone()
        restore.mamba_slot = int(req.kv.mamba_pool_idx)
        return adm

    def admit_batch(self, prompts: list[list[int]], *, rem_input_tokens: int = 1 << 14,
                    rem_chunk_tokens: int | None = None) -> list[Admission]:
        """Admit ``prompts`` into one prefill batch through SGLang's own
        ``PrefillAdder`` (its budget, its ``init_load_back`` call, its chunking
        when ``rem_chunk_tokens`` is set), after ``init_next_round_input`` of
        each, as ``get_new_batch_prefill`` does. A request the adder does not
        take is released (``Admission.done``, ``admitted`` False)."""
        from sglang.srt.managers.schedule_policy import AddReqResult, PrefillAdder

        adder = PrefillAdder(self.shape.page_size, self.cache, self.alloc, None, 0.0,
                             rem_input_tokens, rem_chunk_tokens)
        out = []
        stop = False
        for tokens in prompts:
            req = self._req(tokens)
            self.req_pool.alloc([req])
            req.init_next_round_input(self.cache)
            hit, device_prefix = int(req.host_hit_length), int(req.prefix_len)
            if not stop:
                result = adder.add_one_req(req, has_chunked_req=adder.new_chunked_req is not None,
                                           truncation_align_size=None)
                stop = result is not AddReqResult.CONTINUE
            admitted = req in adder.can_run_list or req is adder.new_chunked_req
            loaded = int(req.host_loaded_length) if admitted else 0
            adm = Admission(tokens, req, Restore(req.rid, hit, loaded, ok=False),
                            device_prefix=device_prefix)
            adm.admitted = admitted
            adm.chunked = req is adder.new_chunked_req
            if loaded:
                adm.restore.tail = self.cache.linker.private_load_indices[req.rid].clone()
                adm.restore.mamba_slot = int(req.kv.mamba_pool_idx)
            else:
                self.cache.linker.release_request(req.rid)
                self._release(req, None)
                adm.done = True
            out.append(adm)
        return out

    def abort(self, adm: Admission) -> None:
        """SGLang's path for a request aborted while queued or loading
        (``release_request``); a load not started yet is cancelled, its slots
        and row freed at once. One already started is finished by ``finish``."""
        self.cache.linker.release_request(adm.req.rid)
        adm.aborted = True
        if adm.req.rid not in self.cache.linker.inflight_load_rids:
            self._release(adm.req, adm.restore.tail)
            adm.done = True

    def start_loads(self) -> int:
        """``ready_to_load_host_cache`` and the model runner's ``set_consumer``."""
        self._started = time.perf_counter()
        index = int(self.cache.ready_to_load_host_cache())
        self.linker.layer_done_counter.set_consumer(index)
        return index

    def finish(self, adms: list[Admission]) -> list[str]:
        """After the batch's forward: ``finish_external_linker_loads`` over the
        batch's requests, then each request whose load landed inserts its
        restored prefix into the tree and one whose load failed (or that was
        aborted) is released. Returns the failed rids."""
        live = [a for a in adms if not a.done]
        failed = {r.rid for r in self.cache.finish_external_linker_loads([a.req for a in live])}
        settled = time.perf_counter() - self._started
        self.linker.layer_done_counter.set_consumer(-1)
        for adm in live:
            adm.restore.settled_s = settled
            adm.restore.ok = adm.req.rid not in failed and not adm.aborted
            self._complete(adm)
        return sorted(failed)

    def _complete(self, adm: Admission) -> None:
        from sglang.srt.mem_cache.base_prefix_cache import InsertParams
        from sglang.srt.mem_cache.radix_cache import RadixKey
        from sglang.srt.mem_cache.unified_cache.components import ComponentType

        req, tail, adm.done = adm.req, adm.restore.tail, True
        assert tail is not None
        if not adm.restore.ok:
            self._release(req, tail)
            return
        d = adm.device_prefix
        n = d + adm.restore.loaded_tokens
        device = self.cache.tree_core.collect_full_device_indices(
            req.last_node, self.cache.root_node_handle())[:d]
        params = InsertParams(
            key=RadixKey(array("q", adm.tokens[:n])), prev_prefix_len=d,
            value=torch.cat([device.to(torch.int64), tail.to(torch.int64)]),
            mamba_value=req.kv.mamba_pool_idx.unsqueeze(0))
        # What SWA's prepare_for_caching_req passes: the SWA pages before the
        # loaded window were never loaded and enter the tree as tombstones.
        params.set_evicted_seqlen(ComponentType.SWA, req.kv.get_evicted_seqlen(ComponentType.SWA))
        result = self.cache.insert(params)
        if result.mamba_exist:
            self.req_pool.mamba_allocator.free(req.kv.mamba_pool_idx.unsqueeze(0))
        req.kv.mamba_pool_idx = None
        self._release(req, None)

    def restore(self, tokens: list[int], before_start: Callable[[], None] | None = None,
                compute_s: float = 0.0) -> Restore:
        """One request for ``tokens`` alone in its batch: ``admit``, the
        layer-wise load, the forward stand-in, ``finish``. ``before_start``
        runs between ``init_load_back`` and the start of the layer-wise load
        (a test's fault point)."""
        adm = self.admit(tokens)
        if adm.done:
            return adm.restore
        if before_start is not None:
            before_start()
        self.start_loads()
        self.forward(adm, compute_s)
        self.finish([adm])
        return adm.restore

    def flush_cache(self) -> None:
        """What SGLang's ``Scheduler.flush_cache`` does to the cache on an idle
        server (and a weight update): ``tree_cache.reset()`` (the linker's
        ``reset`` first), then the pools' and allocators' clears."""
        self.cache.reset()
        self.req_pool.clear()
        self.alloc.clear()
        self.req_pool.reset_aux_cache_allocator()

    def _release(self, req: Any, tail: torch.Tensor | None) -> None:
        """Give back what the request held: its private slots (a failed load),
        its Mamba slot, its row, its node lock."""
        if tail is not None:
            self.alloc.free(tail)
        if req.kv.mamba_pool_idx is not None:
            self.req_pool.mamba_allocator.free(req.kv.mamba_pool_idx.unsqueeze(0))
            req.kv.mamba_pool_idx = None
        self.req_pool.free(req)

    def expected(self, tokens: list[int], start: int = 0) -> dict[int, list[torch.Tensor]]:
        """What the forward must read after restoring ``tokens`` from token
        ``start`` on (the bytes the harness model gives that prefix), in
        ``Restore.layers``' form."""
        return {layer: self.expected_layer(tokens, layer, start)
                for layer in range(len(self.shape.kinds))}

    def expected_layer(self, tokens: list[int], layer: int, start: int = 0) -> list[torch.Tensor]:
        """One layer of :meth:`expected` (a check that compares layer by layer
        holds one layer's expected bytes at a time)."""
        p = self.shape.page_size
        if self.shape.kinds[layer] == "M":
            cache = self.req_pool.mamba_pool.mamba_cache
            return [model_bytes(tokens, 100 * layer + n, tuple(s.shape[2:]), s.dtype)
                    for n, s in enumerate((cache.temporal, *cache.conv))]
        pages = range(start // p, len(tokens) // p)
        if self.shape.kinds[layer] == "S":
            window_pages = -(-self.shape.window // p)
            pages = pages[-window_pages:]
        k = self.kv.full_kv_pool.k_buffer[0]
        digests = prefix_digests(tokens, [(q + 1) * p for q in pages])
        return [model_states(digests, 2 * layer + h, (p, *k.shape[1:]), k.dtype)
                .reshape(-1, *k.shape[1:]) for h in (0, 1)]

    def close(self) -> None:
        self.cache.linker.close()
