"""One suite, every Store backend: the same assertions on MemoryStore and MooncakeStore."""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest
import torch

from layerlift.linker.master import EmbeddedMaster
from layerlift.linker.memory_store import MemoryStore
from layerlift.linker.mooncake_store import MooncakeStore
from layerlift.linker.store_base import Store, StoreError, StoreIOError, StoreKeyMissing

LAYERS = 4
LAYER_BYTES = 1024
PAGE_BYTES = LAYERS * LAYER_BYTES
PAGES = 6


@pytest.fixture(scope="module")
def shared_mooncake(mooncake_master: EmbeddedMaster) -> Iterator[MooncakeStore]:
    """One client for the module: closing a Mooncake client costs ~2 s, so only the
    close test pays for its own (`mooncake_store`). Keys are per-test (`ns`)."""
    config = mooncake_master.config(global_segment_size=64 << 20, local_buffer_size=32 << 20)
    with MooncakeStore(config) as store:
        yield store


@pytest.fixture(params=["memory", pytest.param("mooncake", marks=pytest.mark.mooncake)])
def store(request: pytest.FixtureRequest) -> Iterator[Store]:
    _REGISTERED.clear()
    if request.param == "memory":
        with MemoryStore() as memory:
            yield memory
        return
    shared: MooncakeStore = request.getfixturevalue("shared_mooncake")
    yield shared
    while _REGISTERED:  # the test's tensors die with it
        shared.unregister(_REGISTERED.pop())


@pytest.fixture
def closable(request: pytest.FixtureRequest) -> Iterator[Store]:
    """A store of each kind that the test may close."""
    if request.param == "memory":
        yield MemoryStore()
    else:
        yield request.getfixturevalue("mooncake_store")


@pytest.fixture
def ns(request: pytest.FixtureRequest) -> str:
    return str(request.getfixturevalue("mooncake_namespace"))


_REGISTERED: set[int] = set()  # memory the current test registered


def _register(store: Store, tensor: torch.Tensor) -> None:
    _REGISTERED.add(store.register(tensor))


def _pages(store: Store, ns: str, n: int = PAGES) -> tuple[list[str], torch.Tensor]:
    """Put n layer-major page objects with distinct bytes; return (keys, source tensor)."""
    src = torch.randint(0, 256, (n, PAGE_BYTES), dtype=torch.uint8)
    _register(store, src)
    keys = [f"{ns}/full/0/{i:04x}" for i in range(n)]
    store.put(keys, [int(src[i].data_ptr()) for i in range(n)], [PAGE_BYTES] * n)
    return keys, src


def _dst(store: Store, *shape: int) -> torch.Tensor:
    dst = torch.zeros(*shape, dtype=torch.uint8)
    _register(store, dst)
    return dst


def test_put_exists_get_round_trip(store: Store, ns: str) -> None:
    keys, src = _pages(store, ns)
    assert store.exists([*keys, f"{ns}/nope"]) == [True] * PAGES + [False]
    dst = _dst(store, PAGES, PAGE_BYTES)
    found = store.get(keys, [int(dst[i].data_ptr()) for i in range(PAGES)], [PAGE_BYTES] * PAGES)
    assert found == [True] * PAGES
    assert torch.equal(dst, src)


def test_get_missing_key_is_false(store: Store, ns: str) -> None:
    keys, src = _pages(store, ns, 2)
    dst = _dst(store, 3, PAGE_BYTES)
    ptrs = [int(dst[i].data_ptr()) for i in range(3)]
    found = store.get([keys[0], f"{ns}/missing", keys[1]], ptrs, [PAGE_BYTES] * 3)
    assert found == [True, False, True]
    assert torch.equal(dst[0], src[0]) and torch.equal(dst[2], src[1])


@pytest.mark.parametrize("in_session", [True, False])
def test_per_layer_ranged_gets(store: Store, ns: str, in_session: bool) -> None:
    keys, src = _pages(store, ns)
    dst = _dst(store, LAYERS, PAGES, LAYER_BYTES)  # layer-major destination, one row per page

    def load_layer(layer: int) -> None:
        store.get_ranges(
            keys,
            [[int(dst[layer, i].data_ptr())] for i in range(PAGES)],
            [[LAYER_BYTES]] * PAGES,
            [[layer * LAYER_BYTES]] * PAGES,
        )

    if in_session:
        with store.open_session(keys):
            for layer in range(LAYERS):
                load_layer(layer)
    else:
        for layer in range(LAYERS):
            load_layer(layer)
    expected = src.view(PAGES, LAYERS, LAYER_BYTES).transpose(0, 1)
    assert torch.equal(dst, expected)


def test_ranged_get_several_slices_per_object(store: Store, ns: str) -> None:
    keys, src = _pages(store, ns, 2)
    dst = _dst(store, 2, 2, 100)
    store.get_ranges(
        keys,
        [[int(dst[i, 0].data_ptr()), int(dst[i, 1].data_ptr())] for i in range(2)],
        [[100, 100]] * 2,
        [[10, 3000]] * 2,
    )
    for i in range(2):
        assert torch.equal(dst[i, 0], src[i, 10:110])
        assert torch.equal(dst[i, 1], src[i, 3000:3100])


def test_ranged_get_missing_key_raises(store: Store, ns: str) -> None:
    keys, _ = _pages(store, ns, 2)
    dst = _dst(store, 3, 16)
    with pytest.raises(StoreKeyMissing) as info:
        store.get_ranges(
            [keys[0], f"{ns}/gone", keys[1]],
            [[int(dst[i].data_ptr())] for i in range(3)],
            [[16]] * 3,
            [[0]] * 3,
        )
    assert info.value.keys == (f"{ns}/gone",)
    with pytest.raises(StoreKeyMissing), store.open_session([keys[0], f"{ns}/gone"]):
        pass


def test_size_mismatch_raises(store: Store, ns: str) -> None:
    keys, _ = _pages(store, ns, 1)
    dst = _dst(store, 2 * PAGE_BYTES)
    for size in (PAGE_BYTES // 2, 2 * PAGE_BYTES):
        with pytest.raises(StoreIOError):
            store.get(keys, [int(dst.data_ptr())], [size])
    with pytest.raises(StoreIOError):  # slice past the end of the object
        store.get_ranges(keys, [[int(dst.data_ptr())]], [[64]], [[PAGE_BYTES - 32]])


def test_put_existing_key_is_success_and_keeps_first(store: Store, ns: str) -> None:
    keys, src = _pages(store, ns, 1)
    other = _dst(store, PAGE_BYTES)
    other.fill_(7)
    store.put(keys, [int(other.data_ptr())], [PAGE_BYTES])
    dst = _dst(store, PAGE_BYTES)
    assert store.get(keys, [int(dst.data_ptr())], [PAGE_BYTES]) == [True]
    assert torch.equal(dst, src[0])


def test_remove_is_best_effort(store: Store, ns: str) -> None:
    keys, _ = _pages(store, ns, 2)
    time.sleep(0.1)  # the test master's read lease is 50 ms
    store.remove([*keys, f"{ns}/never-there"])
    assert store.exists(keys) == [False, False]


def test_empty_batches(store: Store) -> None:
    assert store.exists([]) == []
    assert store.get([], [], []) == []
    store.put([], [], [])
    store.get_ranges([], [], [], [])
    with pytest.raises(ValueError):
        store.get(["a"], [], [])


@pytest.mark.parametrize(
    "closable", ["memory", pytest.param("mooncake", marks=pytest.mark.mooncake)], indirect=True
)
def test_close_is_idempotent_and_use_after_close_fails(closable: Store, ns: str) -> None:
    keys, _ = _pages(closable, ns, 1)
    closable.close()
    closable.close()
    with pytest.raises(StoreError):
        closable.exists(keys)
    with pytest.raises(StoreError):
        closable.get(keys, [1], [PAGE_BYTES])


def test_put_parts_concatenates_the_buffers_of_each_object(store: Store, ns: str) -> None:
    """An object put from two buffers (a page and its footer) reads back as
    their concatenation, whole and by range (one range in each part)."""
    pages = torch.randint(0, 256, (2, PAGE_BYTES), dtype=torch.uint8)
    footers = torch.randint(0, 256, (2, 16), dtype=torch.uint8)
    _register(store, pages)
    _register(store, footers)
    keys = [f"{ns}/parts/{i}" for i in range(2)]
    store.put_parts(keys, [[int(pages[i].data_ptr()), int(footers[i].data_ptr())] for i in range(2)],
                    [[PAGE_BYTES, 16]] * 2)
    whole = torch.zeros(2, PAGE_BYTES + 16, dtype=torch.uint8)
    _register(store, whole)
    assert store.get(keys, [int(whole[i].data_ptr()) for i in range(2)], [PAGE_BYTES + 16] * 2) \
        == [True, True]
    assert torch.equal(whole[:, :PAGE_BYTES], pages) and torch.equal(whole[:, PAGE_BYTES:], footers)
    part = torch.zeros(2, LAYER_BYTES + 4, dtype=torch.uint8)
    _register(store, part)
    with store.open_session(keys):
        store.get_ranges(keys, [[int(part[i].data_ptr()), int(part[i].data_ptr()) + LAYER_BYTES]
                                for i in range(2)],
                         [[LAYER_BYTES, 4]] * 2, [[LAYER_BYTES, PAGE_BYTES + 4]] * 2)
    assert torch.equal(part[:, :LAYER_BYTES], pages[:, LAYER_BYTES : 2 * LAYER_BYTES])
    assert torch.equal(part[:, LAYER_BYTES:], footers[:, 4:8])


@pytest.mark.parametrize(("sizes", "offsets", "match"), [
    ([[-1]], [[0]], "negative"), ([[4]], [[-4]], "negative"), ([[]], [[]], "no slices"),
    ([[4, 4]], [[0]], "disagree"),
])
def test_get_ranges_arguments_are_checked_alike(store: Store, ns: str, sizes: list[list[int]],
                                                 offsets: list[list[int]], match: str) -> None:
    dst = torch.zeros(64, dtype=torch.uint8)
    _register(store, dst)
    ptrs = [[int(dst.data_ptr())] * len(sizes[0])] if sizes[0] else [[]]
    with pytest.raises(ValueError, match=match):
        store.get_ranges([f"{ns}/x"], ptrs, sizes, offsets)


def test_the_default_put_parts_copies_for_a_backend_without_one() -> None:
    """A third-party Store without its own multi-buffer put still takes the
    engine's page + footer objects (the base class copies them into one
    registered buffer for the call)."""

    class PlainPuts(MemoryStore):
        def put_parts(self, keys, ptrs, sizes, **kw):  # type: ignore[no-untyped-def]
            return Store.put_parts(self, keys, ptrs, sizes)

    with PlainPuts() as plain:
        a = torch.arange(64, dtype=torch.uint8)
        b = torch.arange(100, 108, dtype=torch.uint8)
        plain.register(a)
        plain.register(b)
        plain.put_parts(["k"], [[int(a.data_ptr()), int(b.data_ptr())]], [[64, 8]])
        assert plain.object_bytes("k") == bytes(a.tolist() + b.tolist())
        assert [c.method for c in plain.calls][-3:] == ["register", "put", "unregister"]
