"""Bytes between vLLM's blocks and registered staging.

A store object of one KV cache group is its layers' blocks, layer-major, then
one CRC-32C per layer (`layerlift.linker.integrity`: seeded with the key and
the layer, so a foreign object or a swapped slice fails too): the
`ObjectLayout` of ``linker/staged.py`` with one slice per layer. Plain and
synchronous: the worker stages offloads on vLLM's thread; restores go through
`StagedLoad` (the worker's sink copies verified rows with `block_bytes`), or,
on the host path at a real block size, in place: `BlockPlacement` names the
blocks the store writes each layer's slices into, verified there.

On a device (CUDA, or the simulated device of the tests) the same bytes move
with index copies instead: `scatter_rows` writes a segment's verified rows
into its blocks (issued on the load stream by `BlockSink`), `gather_pages`
reads a run of blocks as page bytes (issued on the save stream by
``DeviceSnapshot``) and `stage_pages` lays the footers over what a snapshot
staged.
"""

from __future__ import annotations

import ctypes
import itertools
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np
import torch

from layerlift.hosts.vllm.layout import GroupLayout, Layout
from layerlift.linker.integrity import CHECK_BYTES, checksums, copy_checksum, slice_seed
from layerlift.linker.ring import Region
from layerlift.linker.staged import DeviceSink, Gate, LoadPart, LoadSegment
from layerlift.linker.store_base import StoreTimeout
from layerlift.overlap.device import Device

__all__ = ["BlockPlacement", "BlockSink", "HostBlocks", "KeyedItem", "block_bytes", "block_table", "copy_page",
           "gather_pages", "group_runs", "host_blocks", "scatter_rows", "stage_objects", "stage_pages"]

# (group index, store key, block id): an item with the key of this worker's rank
KeyedItem = tuple[int, str, int]


def block_bytes(kv: torch.Tensor, block_id: int) -> torch.Tensor:
    """Block ``block_id`` of a layer's KV tensor as a flat uint8 view."""
    return kv[block_id].view(torch.uint8).view(-1)


def stage_objects(layout: Layout, kv: dict[str, torch.Tensor], items: Sequence[KeyedItem],
                  scratch: Region, blocks: Mapping[str, HostBlocks | None] | None = None
                  ) -> tuple[list[int], list[int]]:
    """Copy each item's layer blocks into ``scratch`` with its CRC footer
    (`copy_page`); return the objects' addresses and sizes."""
    groups = {g.index: g for g in layout.groups}
    ptrs, sizes, at = [], [], 0
    for g, key, block in items:
        group = groups[g]
        size = layout.object_bytes(group)
        page = size - CHECK_BYTES * len(group.layer_names)
        crcs = copy_page(layout, group, kv, key, block, scratch.tensor[at:at + page], blocks)
        ctypes.memmove(scratch.ptr + at + page, crcs.ctypes.data, crcs.nbytes)
        ptrs.append(scratch.ptr + at)
        sizes.append(size)
        at += size
    return ptrs, sizes


def copy_page(layout: Layout, group: GroupLayout, kv: dict[str, torch.Tensor], key: str,
              block: int, dst: torch.Tensor,
              blocks: Mapping[str, HostBlocks | None] | None = None) -> np.ndarray:
    """Copy block ``block`` of each of ``group``'s layers into ``dst`` (one
    page: ``uint8[page_bytes]``, contiguous, host memory), layer-major, and
    return the object's footer (``uint32[layers]``, the slices' CRC-32C
    seeded for ``key``) computed over the copied bytes. A layer with its
    `HostBlocks` in ``blocks`` is copied with ``memmove`` and checksummed in
    ``dst`` right after its copy, still in the cache (``copy_checksum``:
    one pass over the staged bytes); others with torch, then a CRC pass."""
    blocks = blocks or {}
    base = int(dst.data_ptr())
    slices = layout.slices(group)
    crcs = np.empty(len(slices), dtype="<u4")
    for j, (name, (off, size)) in enumerate(zip(group.layer_names, slices, strict=True)):
        seed, host = slice_seed(key, j), blocks.get(name)
        if host is not None:
            crcs[j] = copy_checksum(base + off, [(host.address(block, size), size)], seed)
        else:
            dst[off:off + size].copy_(block_bytes(kv[name], block))
            crcs[j] = checksums([base + off], size, [seed])[0]
    return crcs


class HostBlocks:
    """A host KV tensor's blocks as addresses: block ``b`` is ``nbytes`` at
    ``base + b * stride`` (the rows `block_table` sees). The host path copies
    them with ``memmove``, one call a block: torch's ``copy_`` of a block
    starts its intra-op threads, which compete with the store's transfer
    threads for the cores (a restore at 0.57x of the raw ranged read, page
    128, before). Holds the tensor: its memory outlives every address."""

    __slots__ = ("base", "count", "nbytes", "stride", "tensor")

    def __init__(self, table: torch.Tensor) -> None:
        self.tensor = table
        self.base, self.stride = int(table.data_ptr()), int(table.stride(0))
        self.count, self.nbytes = int(table.shape[0]), int(table.shape[1])

    def address(self, block: int, nbytes: int) -> int:
        """Where block ``block`` starts; ``nbytes``: what the caller copies
        (IndexError for a block the cache does not have, ValueError for a
        size that is not the block's: never an address outside it)."""
        if not 0 <= block < self.count:
            raise IndexError(f"LayerLift: block {block} is not a block of this KV cache "
                             f"({self.count} blocks)")
        if nbytes != self.nbytes:
            raise ValueError(f"LayerLift: a block of this KV cache is {self.nbytes} bytes, "
                             f"not the layout's {nbytes}")
        return self.base + block * self.stride


class BlockPlacement:
    """An in-place restore's destination (a `Placement` of ``linker/sinks.py``):
    vLLM's host blocks, registered with the store. The parts' targets are
    ``(group, blocks)`` as the staged restore's; ``names[group]`` are the
    group's layer names in slice order. Every block and every layer's block
    size is checked once, here (ValueError: the restore is refused before
    anything is read); a layer's addresses are then one array operation.
    A read that timed out keeps counting in ``gate``'s reads in flight until
    its call ended (`Gate.keep_until`): the worker hands the blocks back to
    vLLM only once none is (vLLM reuses them then)."""

    def __init__(self, blocks: Mapping[str, HostBlocks | None], names: Mapping[int, Sequence[str]],
                 parts: Sequence[LoadPart], sizes: Mapping[str, int], gate: Gate) -> None:
        self.gate = gate
        self._rows: dict[int, np.ndarray] = {}
        self._tables: dict[tuple[int, int], HostBlocks] = {}
        for part in parts:
            g, ids = part.target
            rows = np.asarray(ids, dtype=np.int64)
            for j, name in enumerate(names[g]):
                host = blocks.get(name)
                if host is None:
                    raise ValueError(f"LayerLift: layer {name}'s KV cache has no host block "
                                     "table; it cannot be restored in place")
                if host.nbytes != sizes[name]:
                    raise ValueError(f"LayerLift: a block of {name} is {host.nbytes} bytes, "
                                     f"not the layout's {sizes[name]}")
                if rows.size and (int(rows.min()) < 0 or int(rows.max()) >= host.count):
                    raise ValueError(f"LayerLift: the restore names a block outside {name}'s "
                                     f"{host.count} blocks")
                self._tables[(g, j)] = host
            self._rows[g] = rows

    def pieces(self, part: LoadPart, local: int) -> tuple[int, ...]:
        return (part.layout.slices[local][1],)  # a layer's block is one run

    def addresses(self, seg: LoadSegment, part: LoadPart) -> list[int]:
        g = part.target[0]
        host = self._tables[(g, seg.local)]
        out: list[int] = (host.base + self._rows[g][seg.lo : seg.hi] * host.stride).tolist()
        return out

    def pages(self, part: LoadPart) -> list[int]:
        raise ValueError("vLLM's blocks hold one layer each: an object is never read whole "
                         "into them")

    def timed_out(self, part: LoadPart, lo: int, hi: int, exc: StoreTimeout) -> None:
        self.gate.keep_until(exc)


def host_blocks(kv: torch.Tensor) -> HostBlocks | None:
    """``kv``'s blocks as `HostBlocks` when it is a CPU tensor whose blocks
    are evenly strided contiguous rows, else None (then copy with torch)."""
    if kv.device.type != "cpu":
        return None
    table = block_table(kv)
    return None if table is None else HostBlocks(table)


def block_table(kv: torch.Tensor) -> torch.Tensor | None:
    """A layer's KV tensor as ``uint8[num_blocks, block_bytes]`` (one row per
    block: a view, writes reach the cache), or None when its blocks are not
    laid out as evenly strided contiguous rows (then copy block by block)."""
    if kv.dim() < 2 or not kv[0].is_contiguous() or kv.stride(-1) != 1:
        return None
    size = kv.element_size()
    row = kv[0].numel() * size
    raw = kv.view(torch.uint8)
    if kv.stride(0) * size < row:
        return None  # overlapping blocks: not a block table
    return raw.as_strided((int(kv.shape[0]), row), (kv.stride(0) * size, 1))


def _index(blocks: Sequence[int], device: torch.device) -> torch.Tensor:
    """``blocks`` as an index on ``device``. To CUDA from pinned memory: an
    asynchronous copy on the current stream (from pageable memory the copy
    would first wait for that stream on the host); torch's pinned allocator
    keeps the buffer until the copy ran."""
    index = torch.tensor(list(blocks), dtype=torch.int64)
    if device.type == "cpu":
        return index
    return index.pin_memory().to(device, non_blocking=True)


def scatter_rows(kv: torch.Tensor, blocks: Sequence[int], rows: torch.Tensor) -> None:
    """Write ``rows[i]`` (``uint8[n, block_bytes]``, on ``kv``'s device) into
    block ``blocks[i]`` of ``kv``; issued on the caller's current stream."""
    with torch.inference_mode():  # vLLM's caches may be inference tensors
        table = block_table(kv)
        if table is not None:
            table.index_copy_(0, _index(blocks, kv.device), rows)
            return
        for i, block in enumerate(blocks):
            block_bytes(kv, block).copy_(rows[i])


def gather_pages(layout: Layout, kv: dict[str, torch.Tensor], group: int,
                 blocks: Sequence[int], pad: int = 0) -> torch.Tensor:
    """Blocks ``blocks`` of ``group``'s layers as ``uint8[n, page_bytes +
    pad]`` (each row one object's page: its layers' blocks, layer-major, then
    ``pad`` zero bytes where the footer goes), on the caches' device; issued
    on the caller's current stream."""
    names = next(g for g in layout.groups if g.index == group).layer_names
    cols = []
    for name in names:
        table = block_table(kv[name])
        if table is not None:
            cols.append(table.index_select(0, _index(blocks, kv[name].device)))
        else:
            cols.append(torch.stack([block_bytes(kv[name], b) for b in blocks]))
    if pad:
        cols.append(torch.zeros((len(blocks), pad), dtype=torch.uint8, device=cols[0].device))
    return torch.cat(cols, dim=1)


def stage_pages(layout: Layout, items: Sequence[KeyedItem], scratch: Region,
                read: Callable[[int, list[int], torch.Tensor], None]) -> tuple[list[int], list[int]]:
    """Like `stage_objects`, with the page bytes copied by ``read(group,
    blocks, objects)`` (``objects``: ``uint8[n, object_bytes]``, the run's
    objects in ``scratch``, contiguous; ``read`` fills each row's page and may
    write anything into its footer, and returns once the bytes are there), one
    call per run of consecutive items of one group; the footers are then
    computed over the staged bytes. Returns the objects' addresses and sizes."""
    groups = {g.index: g for g in layout.groups}
    ptrs: list[int] = []
    sizes: list[int] = []
    at = 0
    for g, run in group_runs(items):
        group, n = groups[g], len(run)
        slices = layout.slices(group)
        page = sum(s for _, s in slices)
        ob = layout.object_bytes(group)
        objects = scratch.tensor[at:at + n * ob].view(n, ob)
        read(g, [b for _, _, b in run], objects)
        for k, (off, size) in enumerate(slices):
            sums = checksums([scratch.ptr + at + r * ob + off for r in range(n)], size,
                             [slice_seed(key, k) for _, key, _ in run])
            objects[:, page + CHECK_BYTES * k:page + CHECK_BYTES * (k + 1)] = torch.from_numpy(
                np.ascontiguousarray(sums).view(np.uint8).reshape(n, CHECK_BYTES))
        ptrs += [scratch.ptr + at + r * ob for r in range(n)]
        sizes += [ob] * n
        at += n * ob
    return ptrs, sizes


def group_runs(items: Sequence[KeyedItem]) -> list[tuple[int, list[KeyedItem]]]:
    """``items`` as runs of consecutive items of one group: ``(group, run)``."""
    return [(g, list(run)) for g, run in itertools.groupby(items, key=lambda it: it[0])]


class BlockSink(DeviceSink):
    """`DeviceSink` on the worker's one load stream: per verified segment an
    H2D copy from the pinned staging and `scatter_rows` into the segment's
    blocks, then an event recorded on the load stream after them (the layer's
    event is its last chunk's). ``drain()`` blocks until every copy issued so
    far ran (before a load is reported, see the worker)."""

    def __init__(self, device: Device, stream: Any,
                 scatter: Callable[[LoadSegment, LoadPart, torch.Tensor], None]) -> None:
        super().__init__(device, scatter, stream)

    def drain(self) -> None:
        """Host-wait for everything issued on the load stream so far."""
        self.mark().synchronize()
