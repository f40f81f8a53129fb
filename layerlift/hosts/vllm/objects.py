"""Bytes between vLLM's blocks and registered staging.

A store object of one KV cache group is its layers' blocks, layer-major, then
one CRC-32 per layer (`layerlift.linker.integrity`: seeded with the key and
the layer, so a foreign object or a swapped slice fails too): the
`ObjectLayout` of ``linker/staged.py`` with one slice per layer. Plain and
synchronous: the worker stages offloads on vLLM's thread; restores go through
`StagedLoad` (the worker's sink copies verified rows with `block_bytes`).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from layerlift.hosts.vllm.layout import Layout
from layerlift.linker.integrity import CHECK_BYTES, checksums, slice_seed
from layerlift.linker.ring import Region

__all__ = ["KeyedItem", "block_bytes", "stage_objects"]

# (group index, store key, block id): an item with the key of this worker's rank
KeyedItem = tuple[int, str, int]


def block_bytes(kv: torch.Tensor, block_id: int) -> torch.Tensor:
    """Block ``block_id`` of a layer's KV tensor as a flat uint8 view."""
    return kv[block_id].view(torch.uint8).view(-1)


def stage_objects(layout: Layout, kv: dict[str, torch.Tensor], items: Sequence[KeyedItem],
                  scratch: Region) -> tuple[list[int], list[int]]:
    """Copy each item's layer blocks into ``scratch`` with its CRC footer;
    return the objects' addresses and sizes."""
    groups = {g.index: g for g in layout.groups}
    ptrs, sizes, at = [], [], 0
    for g, key, block in items:
        group = groups[g]
        slices = layout.slices(group)
        footer = sum(s for _, s in slices)
        for j, (name, (off, size)) in enumerate(zip(group.layer_names, slices, strict=True)):
            scratch.tensor[at + off:at + off + size].copy_(block_bytes(kv[name], block))
            crc = checksums([scratch.ptr + at + off], size, [slice_seed(key, j)])
            start = at + footer + CHECK_BYTES * j
            scratch.tensor[start:start + CHECK_BYTES].copy_(torch.from_numpy(crc.view(np.uint8)))
        ptrs.append(scratch.ptr + at)
        sizes.append(layout.object_bytes(group))
        at += sizes[-1]
    return ptrs, sizes
