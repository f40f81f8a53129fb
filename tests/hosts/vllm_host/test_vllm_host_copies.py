"""The vLLM worker's host path copies blocks with ``memmove`` (`HostBlocks`):
an offload's slices are copied into staging and checksummed there in one
pass (``copy_checksum``), a restore's verified rows are written one
``memmove`` a block. These tests hold those copies to what torch's copies
did: the same staged bytes and footers (checked against the crc32c package, not
the code under test), blocks laid out with a stride between them (a view of
a wider tensor: the bytes between blocks never touched), and no address
outside the cache for a block id or a size the cache does not have. No vLLM
is imported (the worker modules need none): they run in the main suite too.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from crc32c import crc32c

from layerlift.hosts.vllm.layout import GroupKind, GroupLayout, Layout
from layerlift.hosts.vllm.meta import LoadSpec, SaveSpec
from layerlift.hosts.vllm.objects import HostBlocks, host_blocks, stage_objects
from layerlift.hosts.vllm.worker import BlockWorker
from layerlift.linker.integrity import CHECK_BYTES, slice_seed
from layerlift.linker.memory_store import MemoryStore
from layerlift.linker.store_base import ForwardingStore, Store

pytestmark = [pytest.mark.vllm]

NAMES = ("model.layers.0.attn", "model.layers.1.attn", "model.layers.2.attn")
BLOCKS, ROW = 6, 4096  # blocks per layer, bytes of one block of one layer


def _layout(row: int = ROW) -> Layout:
    return Layout((GroupLayout(0, GroupKind.FULL, NAMES),), 16, dict.fromkeys(NAMES, row),
                  "copies", "uint8")


def _random(shape: tuple[int, ...], seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, shape, dtype=torch.uint8, generator=gen)


def _strided(seed: int) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """Per layer a cache whose blocks are the first halves of a wider
    tensor's rows (a stride of two blocks between them), and the wide tensor."""
    wide = {n: _random((BLOCKS, 2 * ROW), seed + i) for i, n in enumerate(NAMES)}
    return {n: w[:, :ROW] for n, w in wide.items()}, wide


def _stage(kv: dict[str, torch.Tensor], items: list[tuple[int, str, int]],
           fused: bool) -> tuple[bytes, list[int]]:
    layout = _layout()
    total = sum(layout.object_bytes(layout.groups[0]) for _ in items)
    buf = torch.full((total,), 0xAB, dtype=torch.uint8)
    scratch = SimpleNamespace(tensor=buf, ptr=int(buf.data_ptr()))
    blocks = {n: host_blocks(t) for n, t in kv.items()} if fused else None
    if fused:
        assert all(isinstance(b, HostBlocks) for b in blocks.values())
    ptrs, _ = stage_objects(layout, kv, items, scratch, blocks)  # type: ignore[arg-type]
    base = int(buf.data_ptr())
    return buf.numpy().tobytes(), [p - base for p in ptrs]


@pytest.mark.parametrize("strided", [False, True], ids=["rows", "strided"])
def test_fused_staging_matches_torch_and_crc32c(strided: bool) -> None:
    kv = _strided(1)[0] if strided else {n: _random((BLOCKS, ROW), 1 + i)
                                         for i, n in enumerate(NAMES)}
    items = [(0, f"key-{b}", b) for b in (4, 0, 5, 2)]
    fused, at = _stage(kv, items, fused=True)
    torch_path, at_torch = _stage(kv, items, fused=False)
    assert fused == torch_path and at == at_torch
    layout = _layout()
    ob, page = layout.object_bytes(layout.groups[0]), ROW * len(NAMES)
    for (_, key, block), start in zip(items, at, strict=True):
        obj = fused[start:start + ob]
        for j, name in enumerate(NAMES):
            want = kv[name][block].numpy().tobytes()
            assert obj[j * ROW:(j + 1) * ROW] == want
            crc = np.frombuffer(obj[page + CHECK_BYTES * j:page + CHECK_BYTES * (j + 1)], "<u4")
            assert int(crc[0]) == crc32c(want, slice_seed(key, j))


def test_a_block_or_size_the_cache_does_not_have_is_refused() -> None:
    rows = host_blocks(torch.zeros(BLOCKS, ROW, dtype=torch.uint8))
    assert rows is not None
    assert rows.address(BLOCKS - 1, ROW) == rows.base + (BLOCKS - 1) * ROW
    for block in (-1, BLOCKS):
        with pytest.raises(IndexError, match="not a block of this KV cache"):
            rows.address(block, ROW)
    with pytest.raises(ValueError, match="not the layout's"):
        rows.address(0, ROW + 1)
    kv = {n: torch.zeros(BLOCKS, ROW, dtype=torch.uint8) for n in NAMES}
    scratch = torch.zeros(4 * ROW * len(NAMES), dtype=torch.uint8)
    with pytest.raises(IndexError):
        stage_objects(_layout(), kv, [(0, "k", BLOCKS)],
                      SimpleNamespace(tensor=scratch, ptr=int(scratch.data_ptr())),  # type: ignore[arg-type]
                      {n: host_blocks(t) for n, t in kv.items()})


def test_blocks_that_are_not_rows_get_no_host_table() -> None:
    # blocks overlapping in memory (a stride shorter than a block): no table
    overlapping = torch.zeros(80, dtype=torch.uint8).as_strided((4, 32), (16, 1))
    assert host_blocks(overlapping) is None
    # a device tensor never takes the host path
    assert host_blocks(torch.zeros(2, 8, dtype=torch.uint8, device="meta")) is None


def test_a_round_trip_through_strided_caches_touches_only_the_blocks() -> None:
    """Offload blocks 1, 3, 4 of strided caches, restore them into blocks 0,
    2, 5 of other strided caches (per layer, then as one request): the
    restored blocks equal the source blocks; every other byte of the wide
    tensors, the halves between blocks included, is as it was."""
    store = MemoryStore()
    layout = _layout()
    src, _ = _strided(10)
    saver = BlockWorker(store, layout, src, schema=layout.schema("copies"),
                        staging_bytes=4 * layout.object_bytes(layout.groups[0]),
                        max_in_flight=2, load_timeout_s=10.0)
    hashes = [bytes([i]) * 16 for i in range(3)]
    try:
        saver.begin_step()
        saver.save([SaveSpec("a", [(0, h, b) for h, b in zip(hashes, (1, 3, 4), strict=True)])])
        assert saver.settle(10.0)
    finally:
        saver.close()
    for sync in (True, False):
        dst, wide = _strided(20)
        before = {n: w.clone() for n, w in wide.items()}
        loader = BlockWorker(store, layout, dst, schema=layout.schema("copies"),
                             staging_bytes=2 * layout.object_bytes(layout.groups[0]),
                             max_in_flight=2, load_timeout_s=10.0)
        try:
            loader.begin_step()
            items = [(0, h, b) for h, b in zip(hashes, (0, 2, 5), strict=True)]
            loader.start_loads([LoadSpec("b", items, sync=sync)])
            if sync:
                for name in NAMES:
                    loader.wait_layer(name)
                assert loader.step_errors() == set()
            else:
                assert loader.results(wait_s=10.0) == ({"b"}, set())
        finally:
            loader.close()
        for name in NAMES:
            for got, want in ((0, 1), (2, 3), (5, 4)):
                assert torch.equal(dst[name][got], src[name][want])
            expect = before[name].clone()
            expect[[0, 2, 5], :ROW] = src[name][[1, 3, 4]]
            assert torch.equal(wide[name], expect), "a byte outside the restored blocks changed"


class _HeldPuts(ForwardingStore):
    """Forwards to ``inner``; a ``put`` waits for ``release`` first."""

    def __init__(self, inner: Store) -> None:
        super().__init__(inner)
        self.started, self.release = threading.Event(), threading.Event()

    def put(self, keys: Sequence[str], ptrs: Sequence[int], sizes: Sequence[int]) -> None:
        self.started.set()
        assert self.release.wait(30), "the test never released the put"
        self.inner.put(keys, ptrs, sizes)


def test_settle_waits_for_the_puts_in_flight() -> None:
    """`BlockWorker.settle` is False while a put `save` left in flight is
    held, and True once it ended: the objects are in the store then."""
    store = _HeldPuts(MemoryStore())
    layout = _layout()
    kv = {n: _random((BLOCKS, ROW), 30 + i) for i, n in enumerate(NAMES)}
    worker = BlockWorker(store, layout, kv, schema=layout.schema("settle"),
                         staging_bytes=1 << 20, max_in_flight=2, load_timeout_s=10.0)
    try:
        items = [(0, bytes([7 + b]) * 16, b) for b in range(BLOCKS)]
        keys = [k for _, k, _ in worker.keyed(items)]
        worker.begin_step()
        worker.save([SaveSpec("s", items)])
        assert store.started.wait(10)
        assert not worker.settle(0.05)
        assert not any(store.exists(keys))
        store.release.set()
        assert worker.settle(10.0)
        assert all(store.exists(keys))
    finally:
        store.release.set()
        worker.close()
