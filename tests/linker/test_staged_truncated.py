"""Objects shorter than their layout, and read sessions longer than the lease.

- A truncated (or shorter foreign) object under a valid key fails its chunk as
  :class:`CorruptSlices` naming that key, ``on_corrupt`` hears it, and nothing
  of the chunk reaches the destination: on the in-memory store and on a real
  Mooncake master (whose client answers INVALID_PARAMS for a slice past an
  object's end, as it does for a key without a session).
- A load whose reads outlive the master's read lease (``--default_kv_lease_ttl``)
  still lands byte-exact (the store renews the session); an object removed
  once its lease ran out is missing, never read from freed memory.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator

import pytest
import torch
from test_staged import LAYOUT, SENTINEL, Rows, encode, one_part_load, pages, put_raw

from layerlift.linker.master import EmbeddedMaster
from layerlift.linker.memory_store import MemoryStore
from layerlift.linker.mooncake_store import RENEWALS, MooncakeStore
from layerlift.linker.ring import StagingRing
from layerlift.linker.staged import CorruptSlices
from layerlift.linker.store_base import (
    Store,
    StoreIntegrityError,
    StoreIOError,
    StoreKeyMissing,
    StoreObjectSize,
)

LEASE_MS = 300

# Cut lengths: inside slice 0, at the page's end (footer gone), one footer byte short.
CUTS = [LAYOUT.page_bytes // 3, LAYOUT.page_bytes, LAYOUT.object_bytes - 1]


@pytest.fixture(scope="module")
def short_lease_master(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EmbeddedMaster]:
    """A master whose read lease (300 ms) a test can outlast on purpose."""
    log = tmp_path_factory.mktemp("mooncake-lease") / "mooncake_master.log"
    with EmbeddedMaster(log_path=log, lease_ttl_ms=LEASE_MS, http_metadata=False) as master:
        yield master


@pytest.fixture(params=["memory", pytest.param("mooncake", marks=pytest.mark.mooncake)])
def store(request: pytest.FixtureRequest) -> Iterator[Store]:
    if request.param == "memory":
        yield MemoryStore()
        return
    master: EmbeddedMaster = request.getfixturevalue("short_lease_master")
    mooncake = MooncakeStore(master.config(global_segment_size=32 << 20,
                                           local_buffer_size=16 << 20, timeout_s=10.0))
    yield mooncake
    mooncake.close()


def _outlast_lease(since: float) -> None:
    """Let the master's read lease granted at ``since`` run out (a TTL: only
    time ends it)."""
    end = since + 2 * LEASE_MS / 1000
    while time.monotonic() < end:
        time.sleep(0.02)


@pytest.mark.parametrize("cut", CUTS, ids=["in-slice-0", "no-footer", "footer-short"])
def test_a_truncated_object_is_corrupt_and_never_reaches_the_destination(
        store: Store, cut: int) -> None:
    ns = f"trunc-{uuid.uuid4().hex[:8]}"
    keys = [f"{ns}/p{i}" for i in range(6)]
    src = pages(6, 21)
    objects = {k: encode(k, src[i]) for i, k in enumerate(keys)}
    objects[keys[3]] = objects[keys[3]][:cut]
    put_raw(store, objects)
    ring = StagingRing(store, 64 << 10)
    dest = Rows(6)
    reported: list[str] = []
    load = one_part_load(ring, store, keys, dest, on_corrupt=reported.extend)
    # A layer reads its slice and its footer entry, the first slice the whole footer
    # (the later layers then check against it): a layer fails where what it reads
    # lies past the cut; once layer 0 failed, each later layer reads its own entry.
    cut_off = [max(o + n, LAYOUT.object_bytes if j == 0 else LAYOUT.footer_at(j) + 4) > cut
               for j, (o, n) in enumerate(LAYOUT.slices)]
    assert cut_off[-1]
    with store.open_session(keys):
        for layer, (offset, size) in enumerate(LAYOUT.slices):
            reported.clear()
            if not cut_off[layer]:  # this layer's bytes are all there, under their CRCs
                load.fetch_layer(layer)
                assert torch.equal(dest.rows[:, offset : offset + size],
                                   src[:, offset : offset + size])
                continue
            with pytest.raises(CorruptSlices) as info:
                load.fetch_layer(layer)
            assert info.value.keys == (keys[3],) and info.value.layer == layer
            assert isinstance(info.value.__cause__, StoreObjectSize)
            assert reported == [keys[3]], "on_corrupt did not hear the truncated key"
            assert bool((dest.rows[:, offset : offset + size] == SENTINEL).all()), \
                "a chunk with a truncated object was copied"
    assert dest.writes == sum(not c for c in cut_off)
    assert load.wait_quiet(10.0) and ring.wait_idle(10.0)
    # The same load over the other keys lands exact (only that object is bad).
    good = [k for k in keys if k != keys[3]]
    rest = Rows(5)
    again = one_part_load(ring, store, good, rest)
    with store.open_session(good):
        for layer in range(len(LAYOUT.slices)):
            again.fetch_layer(layer)
    assert torch.equal(rest.rows, torch.cat([src[:3], src[4:]]))
    assert ring.close()


def test_the_store_names_objects_of_another_size(store: Store) -> None:
    ns = f"size-{uuid.uuid4().hex[:8]}"
    key = f"{ns}/short"
    put_raw(store, {key: bytes(range(100))})
    dst = torch.zeros(4096, dtype=torch.uint8)
    ptr = store.register(dst)
    try:
        for size in (50, 4096):
            with pytest.raises(StoreObjectSize) as whole:
                store.get([key], [ptr], [size])
            assert whole.value.keys == (key,)
        with store.open_session([key]):
            with pytest.raises(StoreObjectSize) as ranged:
                store.get_ranges([key], [[ptr, ptr + 200]], [[50, 4]], [[0, 98]])
            assert ranged.value.keys == (key,)
            assert isinstance(ranged.value, StoreIntegrityError)
            store.get_ranges([key], [[ptr]], [[60]], [[40]])  # inside: read
        assert bytes(dst[:60].numpy()) == bytes(range(40, 100))
    finally:
        store.unregister(ptr)


# ---- the read session and the master's lease ------------------------------------


@pytest.mark.mooncake
def test_a_load_longer_than_the_read_lease_lands_byte_exact(
        short_lease_master: EmbeddedMaster) -> None:
    store = MooncakeStore(short_lease_master.config(
        global_segment_size=32 << 20, local_buffer_size=16 << 20, timeout_s=10.0))
    try:
        ns = f"lease-{uuid.uuid4().hex[:8]}"
        keys = [f"{ns}/p{i}" for i in range(8)]
        src = pages(8, 22)
        put_raw(store, {k: encode(k, src[i]) for i, k in enumerate(keys)})
        ring = StagingRing(store, 64 << 10)
        dest = Rows(8)
        reported: list[str] = []
        load = one_part_load(ring, store, keys, dest, on_corrupt=reported.extend)
        opened = time.monotonic()
        with store.open_session(keys):
            load.fetch_layer(0)
            _outlast_lease(opened)  # layer 1's read ends past the session's lease
            load.fetch_layer(1)
            _outlast_lease(time.monotonic())  # and again past the renewed one
            load.fetch_layer(2)
        assert torch.equal(dest.rows, src) and not reported
        assert ring.wait_idle(10.0) and ring.close()
    finally:
        store.close()


@pytest.mark.mooncake
def test_an_object_removed_after_the_lease_is_missing_not_read(
        short_lease_master: EmbeddedMaster) -> None:
    config = short_lease_master.config(global_segment_size=32 << 20,
                                       local_buffer_size=16 << 20, timeout_s=10.0)
    store, other = MooncakeStore(config), MooncakeStore(config)
    try:
        ns = f"gone-{uuid.uuid4().hex[:8]}"
        keys = [f"{ns}/p{i}" for i in range(4)]
        src = pages(4, 23)
        put_raw(store, {k: encode(k, src[i]) for i, k in enumerate(keys)})
        ring = StagingRing(store, 64 << 10)
        dest = Rows(4)
        load = one_part_load(ring, store, keys, dest)
        opened = time.monotonic()
        with store.open_session(keys):
            load.fetch_layer(0)
            _outlast_lease(opened)
            other.remove([keys[2]])  # the lease ran out: the master lets it go
            with pytest.raises(StoreKeyMissing) as info:
                load.fetch_layer(1)
            assert info.value.keys == (keys[2],)
        assert torch.equal(dest.rows[:, :1000], src[:, :1000])
        assert bool((dest.rows[:, 1000:] == SENTINEL).all()), "a failed read was copied"
        assert ring.wait_idle(10.0) and ring.close()
    finally:
        other.close()
        store.close()


class _DroppedSessions:
    """Mooncake's client, whose next ``dropped`` ranged reads answer
    INVALID_PARAMS for every key (what a read sees when another thread's
    read, started under the old lease and ending past it, dropped the
    session just renewed) without reading."""

    def __init__(self, inner: object, dropped: int) -> None:
        self._inner, self.dropped, self.reads = inner, dropped, 0

    def batch_get_into_multi_buffer_ranges(self, keys: list[str], *args: object) -> list[int]:
        self.reads += 1
        if self.dropped:
            self.dropped -= 1
            return [-600] * len(keys)
        return list(self._inner.batch_get_into_multi_buffer_ranges(keys, *args))  # type: ignore[attr-defined]

    def __getattr__(self, name: str) -> object:
        return getattr(self._inner, name)


@pytest.mark.mooncake
@pytest.mark.parametrize("dropped", [1, RENEWALS, RENEWALS + 1])
def test_a_session_dropped_again_after_its_renewal_is_renewed_again(
        short_lease_master: EmbeddedMaster, dropped: int) -> None:
    """Up to ``RENEWALS`` drops in a row the read renews and lands exact;
    one more and it fails with the store's error (bounded), nothing read."""
    store = MooncakeStore(short_lease_master.config(
        global_segment_size=32 << 20, local_buffer_size=16 << 20, timeout_s=10.0))
    try:
        key = f"drop-{uuid.uuid4().hex[:8]}/p0"
        src = pages(1, 24)
        put_raw(store, {key: encode(key, src[0])})
        dst = torch.full((LAYOUT.page_bytes,), SENTINEL, dtype=torch.uint8)
        store.register(dst)
        client = _DroppedSessions(store._client, dropped)
        store._client = client
        with store.open_session([key]):
            call = ([key], [[dst.data_ptr()]], [[LAYOUT.page_bytes]], [[0]])
            if dropped <= RENEWALS:
                store.get_ranges(*call)
                assert torch.equal(dst, src[0]) and client.reads == dropped + 1
            else:
                with pytest.raises(StoreIOError, match="INVALID_PARAMS"):
                    store.get_ranges(*call)
                assert client.reads == RENEWALS + 1
                assert bool((dst == SENTINEL).all())
    finally:
        store.close()
