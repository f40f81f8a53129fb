"""A checking mode for the pool: nothing may be released under a thread.

The engine's ownership rule (``engine/threads.py``): memory a worker thread
may touch is released only after that thread has returned. The sanitizer
turns a broken rule into a loud failure instead of a rare wrong byte:

* every byte block of the pool's buffer carries a *generation* that changes
  whenever a page over it is released (a free, a flush of deferred frees)
  or moved away (a relocation);
* the forward (:meth:`PoolSanitizer.model`), and every store call that reads
  or writes pool memory (:meth:`PoolSanitizer.store`: ``get``,
  ``get_ranges``, ``put``, ``put_parts``) record the generations of what
  they touch when they start and compare them when they return; a change
  is a *violation* (kept in ``violations``, raised by :meth:`check`), even
  if the thread's own caller was cancelled long ago;
* with ``poison=True`` freed pages are filled with ``0xFF`` bytes (NaN in
  float16, bfloat16 and float32), so a forward that reads a freed page
  gives NaN logprobs and a KL check fails.

Use::

    san = PoolSanitizer()
    async with Engine(san.model(model), cfg, store=san.store(store)) as engine:
        san.attach(engine.pool)
        ...
        san.check()

Test support only; production code never imports it.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np
import torch

from layerlift.linker.store_base import ForwardingStore, Store
from layerlift.pools.base import KVPool
from layerlift.pools.spec import Component

__all__ = ["PoolSanitizer", "SanitizerViolation"]

BLOCK = 64  # bytes per generation counter


class SanitizerViolation(AssertionError):
    """Memory was released while a thread that uses it was still running."""


class PoolSanitizer:
    """Generations per byte block of one pool; see the module docstring."""

    def __init__(self, *, poison: bool = True) -> None:
        self.poison = poison
        self.pool: KVPool | None = None
        self.violations: list[str] = []
        self.checked = 0  # thread spans checked (a test can assert the sanitizer ran)
        self._gen = np.zeros(0, dtype=np.int64)
        self._base = 0
        self._lock = threading.Lock()

    # ---- wiring ------------------------------------------------------------------
    def attach(self, pool: KVPool) -> None:
        """Start watching ``pool`` (after ``Engine.start`` built it)."""
        buf = pool.buffer
        self.pool = pool
        self._base = buf.data_ptr()
        nbytes = buf.numel() * buf.element_size()
        self._gen = np.zeros(nbytes // BLOCK + 1, dtype=np.int64)
        # Hook the one place a page becomes free: each sub-allocator's
        # ``release`` (a direct free, a flush of deferred frees, the
        # shortfall ladder inside ``alloc``). A deferred free is not a
        # release: the page stays pinned by whoever still uses it.
        for sub in pool.core.chain:  # type: ignore[attr-defined]
            self._hook(sub, Component(sub.name))
        pool.add_move_listener(self._moved)

    def _hook(self, sub: Any, component: Component) -> None:
        release = sub.release

        def checked_release(idx: np.ndarray) -> None:
            release(idx)
            self._released(component, [int(i) for i in np.asarray(idx).reshape(-1)])

        sub.release = checked_release

    def model(self, inner: Any) -> _CheckedModel:
        """A model wrapper whose forward is one checked span over its pages."""
        return _CheckedModel(inner, self)

    def store(self, inner: Store) -> _CheckedStore:
        """A store wrapper whose calls that touch pool memory are checked spans."""
        return _CheckedStore(inner, self)

    def check(self) -> None:
        """Raise :class:`SanitizerViolation` listing every violation seen."""
        if self.violations:
            raise SanitizerViolation(
                f"{len(self.violations)} release(s) under a running thread:\n"
                + "\n".join(self.violations[:10]))

    # ---- generations -----------------------------------------------------------------
    def _blocks(self, ptr: int, size: int) -> slice | None:
        off = ptr - self._base
        if self.pool is None or size <= 0 or off < 0 or off >= len(self._gen) * BLOCK:
            return None
        return slice(off // BLOCK, (off + size - 1) // BLOCK + 1)

    def _page_blocks(self, component: Component, indices: Sequence[int]) -> list[slice]:
        assert self.pool is not None
        size = self.pool.page_bytes(component)
        out = []
        for i in indices:
            blocks = self._blocks(self.pool.page_ptr(component, int(i)), size)
            if blocks is not None:
                out.append(blocks)
        return out

    def _released(self, component: Component, idx: list[int]) -> None:
        assert self.pool is not None
        with self._lock:
            for blocks in self._page_blocks(component, idx):
                self._gen[blocks] += 1
        if self.poison:
            for i in idx:
                self.pool.page_view(component, i).fill_(0xFF)

    def _moved(self, component: Component, old: torch.Tensor, new: torch.Tensor) -> None:
        with self._lock:
            for blocks in self._page_blocks(component, old.reshape(-1).tolist()):
                self._gen[blocks] += 1

    @contextlib.contextmanager
    def span(self, what: str, blocks: list[slice]) -> Iterator[None]:
        """Check that no block of ``blocks`` is released while the body runs."""
        with self._lock:
            before = [self._gen[b].copy() for b in blocks]
        try:
            yield
        finally:
            with self._lock:
                changed = any(not np.array_equal(self._gen[b], g)
                              for b, g in zip(blocks, before, strict=True))
                self.checked += 1
            if changed:
                self.violations.append(
                    f"{what} (thread {threading.current_thread().name}): pool memory it "
                    "uses was freed or moved before it returned")

    def ranges(self, ptrs: Sequence[int], sizes: Sequence[int]) -> list[slice]:
        out = []
        for p, s in zip(ptrs, sizes, strict=True):
            blocks = self._blocks(int(p), int(s))
            if blocks is not None:
                out.append(blocks)
        return out

    def request_blocks(self, requests: Sequence[Any]) -> list[slice]:
        """The pages and slots a forward over ``requests`` reads or writes."""
        if self.pool is None:
            return []
        spec = self.pool.spec
        blocks: list[slice] = []
        for r in requests:
            # SWA entries before the window are placeholders the forward never reads.
            skip = max(0, r.prefix_len // spec.page_size - spec.window_pages)
            blocks += self._page_blocks(Component.FULL, r.full_pages.tolist())
            blocks += self._page_blocks(Component.SWA, r.swa_pages[skip:].tolist())
            slots = [r.mamba_slot, *r.capture.values()]
            if r.mamba_cow_src is not None:
                slots.append(r.mamba_cow_src)
            blocks += self._page_blocks(Component.MAMBA, slots)
        return blocks


class _CheckedModel:
    """Forwards to the model; its ``forward_batch`` is one checked span."""

    def __init__(self, inner: Any, san: PoolSanitizer) -> None:
        self.inner, self.san = inner, san

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def forward_batch(self, requests: Any, pool: Any, before_layer: Any, after_layer: Any) -> Any:
        with self.san.span("the forward", self.san.request_blocks(requests)):
            return self.inner.forward_batch(requests, pool, before_layer, after_layer)


class _CheckedStore(ForwardingStore):
    """Forwards to ``inner``; reads into and puts from pool memory are checked spans."""

    def __init__(self, inner: Store, san: PoolSanitizer) -> None:
        super().__init__(inner)
        self.san = san

    def put(self, keys: Sequence[str], ptrs: Sequence[int], sizes: Sequence[int]) -> None:
        with self.san.span("a put", self.san.ranges(ptrs, sizes)):
            self.inner.put(keys, ptrs, sizes)

    def put_parts(self, keys: Sequence[str], ptrs: Sequence[Sequence[int]],
                  sizes: Sequence[Sequence[int]]) -> None:
        flat_p = [p for row in ptrs for p in row]
        flat_s = [s for row in sizes for s in row]
        with self.san.span("a put", self.san.ranges(flat_p, flat_s)):
            self.inner.put_parts(keys, ptrs, sizes)

    def get(self, keys: Sequence[str], ptrs: Sequence[int], sizes: Sequence[int]) -> list[bool]:
        with self.san.span("a whole-object read", self.san.ranges(ptrs, sizes)):
            return self.inner.get(keys, ptrs, sizes)

    def get_ranges(self, keys: Sequence[str], dst_ptrs: Sequence[Sequence[int]],
                   sizes: Sequence[Sequence[int]], src_offsets: Sequence[Sequence[int]]) -> None:
        ptrs = [p for row in dst_ptrs for p in row]
        lens = [s for row in sizes for s in row]
        with self.san.span("a ranged read", self.san.ranges(ptrs, lens)):
            self.inner.get_ranges(keys, dst_ptrs, sizes, src_offsets)
