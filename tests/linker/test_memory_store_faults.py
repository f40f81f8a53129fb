"""MemoryStore fault and latency injection, used by the async side's unit tests."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import pytest
import torch

from layerlift.linker.memory_store import MemoryStore, StoreCall
from layerlift.linker.store_base import (
    StoreError,
    StoreIOError,
    StoreKeyMissing,
    StoreTimeout,
    StoreUnavailable,
)

_KEEP_ALIVE: list[torch.Tensor] = []


@pytest.fixture
def store() -> Iterator[MemoryStore]:
    yield MemoryStore(timeout_s=1.0)
    _KEEP_ALIVE.clear()


def _put(store: MemoryStore, keys: list[str], size: int = 64) -> torch.Tensor:
    src = torch.arange(len(keys) * size, dtype=torch.uint8).view(len(keys), size)
    store.register(src)
    store.put(keys, [int(r.data_ptr()) for r in src], [size] * len(keys))
    # Keep `src` alive for the test: callers drop it, and a later buffer at
    # the same address would collide with its registration (a flaky StoreError).
    _KEEP_ALIVE.append(src)
    return src


def test_latency_applies_per_call_outside_the_lock(store: MemoryStore) -> None:
    _put(store, ["a"])
    store.latency_s = 0.2
    start = time.monotonic()
    threads = [threading.Thread(target=store.exists, args=(["a"],)) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    elapsed = time.monotonic() - start
    assert 0.2 <= elapsed < 0.6  # four calls slept concurrently


def test_latency_beyond_timeout_raises_store_timeout(store: MemoryStore) -> None:
    store.latency_s = 5.0
    start = time.monotonic()
    with pytest.raises(StoreTimeout):
        store.exists(["a"])
    assert time.monotonic() - start < 2.0


def test_fail_kth_call_counts_from_now(store: MemoryStore) -> None:
    _put(store, ["a"])
    store.fail_call(2)
    assert store.exists(["a"]) == [True]
    with pytest.raises(StoreUnavailable):
        store.exists(["a"])
    assert store.exists(["a"]) == [True]
    store.fail_call(1, StoreIOError("boom"))
    with pytest.raises(StoreIOError, match="boom"):
        store.remove(["a"])
    with pytest.raises(ValueError):
        store.fail_call(0)


def test_fail_keys_and_short_reads(store: MemoryStore) -> None:
    _put(store, ["a", "b", "c"])
    dst = torch.zeros(64, dtype=torch.uint8)
    store.register(dst)
    store.fail_keys(["a"])
    store.short_read_keys(["b"])
    with pytest.raises(StoreIOError, match="Injected"):
        store.get(["a"], [int(dst.data_ptr())], [64])
    for call in (
        lambda: store.get(["b"], [int(dst.data_ptr())], [64]),
        lambda: store.get_ranges(["b"], [[int(dst.data_ptr())]], [[8]], [[0]]),
    ):
        with pytest.raises(StoreIOError, match="Short read"):
            call()
    assert store.get(["c"], [int(dst.data_ptr())], [64]) == [True]
    assert store.exists(["a", "b"]) == [True, True]  # metadata calls are unaffected
    store.clear_faults()
    assert store.get(["a"], [int(dst.data_ptr())], [64]) == [True]


def test_drop_key_acts_like_eviction(store: MemoryStore) -> None:
    _put(store, ["a", "b"])
    dst = torch.zeros(64, dtype=torch.uint8)
    store.register(dst)
    store.drop_key("a")
    assert store.get(["a"], [int(dst.data_ptr())], [64]) == [False]
    with pytest.raises(StoreKeyMissing) as info:
        store.get_ranges(["a", "b"], [[int(dst.data_ptr())]] * 2, [[8]] * 2, [[0]] * 2)
    assert info.value.keys == ("a",)


def test_call_log_and_byte_counters(store: MemoryStore) -> None:
    _put(store, ["a", "b"], size=64)
    dst = torch.zeros(2, 64, dtype=torch.uint8)
    store.register(dst)
    store.get(["a"], [int(dst[0].data_ptr())], [64])
    with store.open_session(["a", "b"]):
        store.get_ranges(["a", "b"], [[int(dst[0].data_ptr())], [int(dst[1].data_ptr())]],
                         [[16], [16]], [[0], [8]])  # fmt: skip
    assert [c for c in store.calls if c.method != "register"] == [
        StoreCall("put", ("a", "b")),
        StoreCall("get", ("a",)),
        StoreCall("open_session", ("a", "b")),
        StoreCall("get_ranges", ("a", "b")),
    ]
    assert store.bytes_written == 128
    assert store.bytes_read == 64 + 32


def test_unregistered_memory_is_rejected(store: MemoryStore) -> None:
    src = torch.zeros(64, dtype=torch.uint8)
    with pytest.raises(StoreError, match="register"):
        store.put(["a"], [int(src.data_ptr())], [64])
    ptr = store.register(src)
    store.unregister(ptr)
    with pytest.raises(StoreError):
        store.unregister(ptr)
