"""Helpers of the SGLang host tests (tokens, SGLang's page hashes, the byte
checks, a raw client of the store, store wrappers that inject faults)."""

from __future__ import annotations

import ctypes
import threading
from array import array
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch

from layerlift.linker.integrity import checksums, slice_seed
from layerlift.linker.master import EmbeddedMaster
from layerlift.linker.mooncake_store import MooncakeStore
from layerlift.linker.store_base import ForwardingStore, Store
from layerlift.testing.sglang_harness import HybridShape, SGLangHost, is_zero, same_bytes

SHAPE = HybridShape()
PAGE = SHAPE.page_size


def tokens(n_pages: int, seed: int = 1, start: list[int] | None = None) -> list[int]:
    """``start`` then distinct tokens up to ``n_pages`` pages."""
    head = list(start or [])
    return head + [seed * 10_000 + i for i in range(n_pages * PAGE - len(head))]


def page_hashes(toks: list[int]) -> list[str]:
    """SGLang's storage hashes of the pages of ``toks`` (what its transfers carry)."""
    from sglang.srt.mem_cache.radix_cache import RadixKey
    from sglang.srt.mem_cache.utils import get_storage_hash_str

    return list(get_storage_hash_str(RadixKey(array("q", toks)), None, page_size=PAGE))


def assert_restored(host: SGLangHost, restore: Any, toks: list[int], start: int = 0) -> None:
    """Every layer the forward read equals the bytes of ``toks[:start + loaded]``."""
    for layer, got in restore.layers.items():
        expected = host.expected_layer(toks[: start + restore.loaded_tokens], layer, start)
        for g, e in zip(got, expected, strict=True):
            assert g.shape == e.shape, (layer, g.shape, e.shape)
            assert same_bytes(g, e), f"layer {layer} restored other bytes"


class RawStore:
    """A plain client of the test's master, to read and plant whole objects."""

    def __init__(self, master: EmbeddedMaster) -> None:
        self.store = MooncakeStore(master.config(
            global_segment_size=0, local_buffer_size=16 << 20, timeout_s=5.0,
            metadata_server="P2PHANDSHAKE"))  # as the linkers' clients
        self.buf = torch.zeros(1 << 20, dtype=torch.uint8)
        self.store.register(self.buf)

    def get(self, key: str, size: int) -> bytes:
        assert self.store.get([key], [self.buf.data_ptr()], [size]) == [True]
        return bytes(self.buf[:size].numpy())

    def plant(self, key: str, data: bytes) -> None:
        """Put ``data`` under ``key`` (before the cache offloads it: its own
        put then finds the key taken and leaves this object)."""
        ctypes.memmove(self.buf.data_ptr(), data, len(data))
        self.store.put([key], [self.buf.data_ptr()], [len(data)])


def reseal(obj: bytes, layout: Any, key: str) -> bytes:
    """``obj``'s page bytes with a footer valid for ``key`` (a well-formed object of ``key``)."""
    page = bytearray(obj[: layout.page_bytes])
    base = ctypes.addressof((ctypes.c_char * len(page)).from_buffer(page))
    sums = [int(checksums([base + off], size, [slice_seed(key, j)])[0])
            for j, (off, size) in enumerate(layout.slices)]
    return bytes(page) + np.asarray(sums, dtype="<u4").tobytes()


def full_key(host: SGLangHost, toks: list[int], page: int) -> str:
    return host.linker.key_schema.key("full", bytes.fromhex(page_hashes(toks)[page]))


def on_device(host: SGLangHost, toks: list[int]) -> int:
    from sglang.srt.mem_cache.base_prefix_cache import MatchPrefixParams
    from sglang.srt.mem_cache.radix_cache import RadixKey

    return int(host.cache.match_prefix(
        MatchPrefixParams(key=RadixKey(array("q", toks)))).device_prefix_len)


def exact_or_zero(host: SGLangHost, restore: Any, toks: list[int]) -> dict[int, bool]:
    """Per layer: True when exact (byte for byte), False when zero; fails on
    any other bytes. Builds one layer's expected bytes at a time."""
    out = {}
    for layer, got in restore.layers.items():
        expected = host.expected_layer(toks[: restore.loaded_tokens], layer)
        same = all(same_bytes(g, e) for g, e in zip(got, expected, strict=True))
        assert same or all(is_zero(g) for g in got), f"layer {layer} holds wrong bytes"
        out[layer] = same
    return out


class HookedStore(ForwardingStore):
    """Forwards to a linker's store; ``hooks[call](args)`` runs before the
    call (a test's gate, delay or fault). ``close`` leaves the inner store to
    its linker."""

    def __init__(self, inner: Store, **hooks: Callable[..., None]) -> None:
        super().__init__(inner)
        self.hooks = hooks
        self.calls: list[tuple[str, list[str]]] = []
        self._lock = threading.Lock()

    def _hook(self, call: str, keys: Sequence[str], *args: Any) -> None:
        with self._lock:
            self.calls.append((call, list(keys)))
        hook = self.hooks.get(call)
        if hook is not None:
            hook(list(keys), *args)

    def exists(self, keys: Sequence[str]) -> list[bool]:
        self._hook("exists", keys)
        return self.inner.exists(keys)

    def put(self, keys: Sequence[str], ptrs: Sequence[int], sizes: Sequence[int]) -> None:
        self._hook("put", keys)
        self.inner.put(keys, ptrs, sizes)

    def put_parts(self, keys: Sequence[str], ptrs: Sequence[Sequence[int]],
                  sizes: Sequence[Sequence[int]]) -> None:
        self._hook("put_parts", keys)
        self.inner.put_parts(keys, ptrs, sizes)

    def get_ranges(self, keys: Sequence[str], dst_ptrs: Sequence[Sequence[int]],
                   sizes: Sequence[Sequence[int]], src_offsets: Sequence[Sequence[int]]) -> None:
        self._hook("get_ranges", keys, src_offsets)
        self.inner.get_ranges(keys, dst_ptrs, sizes, src_offsets)

    def close(self) -> None:
        pass


def hook_store(host: SGLangHost, **hooks: Callable[..., None]) -> HookedStore:
    """Route every store call of ``host``'s linker (lookups, loads, offloads)
    through a :class:`HookedStore`."""
    wrapped = HookedStore(host.linker.store, **hooks)
    host.linker.store = wrapped
    host.linker._offloader._store = wrapped
    return wrapped


def scribble(host: SGLangHost, value: float = 7.0) -> None:
    """Other bytes in every slot of every pool (what reuse after a flush leaves)."""
    for pool in (host.kv.full_kv_pool, host.kv.swa_kv_pool):
        for t in (*pool.k_buffer, *pool.v_buffer):
            t.fill_(value)
    cache = host.req_pool.mamba_pool.mamba_cache
    for state in (cache.temporal, *cache.conv):
        state.fill_(value)
