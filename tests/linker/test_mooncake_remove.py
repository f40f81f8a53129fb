"""`MooncakeStore.remove` says whether an object is gone: a read lease (granted
by a read and by ``exists``) keeps an object, and remove then raises
StoreObjectLeased naming it (the other keys of the call are removed); once
the lease ended, remove removes it. A master of its own, with a 2 s lease
(the session master's 50 ms lease could end before the remove under load)."""

from __future__ import annotations

import ctypes
import time
from collections.abc import Iterator

import pytest

from layerlift.linker.master import EmbeddedMaster
from layerlift.linker.mooncake_store import MooncakeStore
from layerlift.linker.store_base import StoreObjectLeased

pytestmark = pytest.mark.mooncake

LEASE_MS = 2000


@pytest.fixture(scope="module")
def leased_master(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EmbeddedMaster]:
    log = tmp_path_factory.mktemp("lease") / "mooncake_master.log"
    with EmbeddedMaster(log_path=log, lease_ttl_ms=LEASE_MS) as master:
        yield master


def test_leased_object_is_reported_not_removed(leased_master: EmbeddedMaster) -> None:
    store = MooncakeStore(leased_master.config(global_segment_size=16 << 20,
                                               local_buffer_size=8 << 20))
    buf = ctypes.create_string_buffer(b"x" * 4096, 4096)
    ptr = ctypes.addressof(buf)
    store.register(ptr, 4096)
    try:
        store.put(["read", "checked", "idle"], [ptr] * 3, [1024] * 3)
        time.sleep(LEASE_MS / 1000 + 0.5)  # the puts' own leases (if any) end
        assert store.get(["read"], [ptr + 2048], [1024]) == [True]
        assert store.exists(["checked"]) == [True]
        with pytest.raises(StoreObjectLeased) as info:
            store.remove(["read", "checked", "idle", "never-there"])
        assert set(info.value.keys) == {"read", "checked"}
        # the idle one is gone, the leased ones are not
        deadline = time.monotonic() + 10 * LEASE_MS / 1000
        while True:  # a lease only ends with time; retry the remove, not exists (it renews)
            try:
                store.remove(["read", "checked"])
                break
            except StoreObjectLeased:
                assert time.monotonic() < deadline, "the read lease never ended"
                time.sleep(0.2)
        assert store.exists(["read", "checked", "idle"]) == [False, False, False]
    finally:
        store.unregister(ptr)
        store.close()
