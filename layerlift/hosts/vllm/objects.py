"""Bytes between vLLM's blocks, registered staging and the store.

A store object of one KV cache group is its layers' blocks, layer-major, then
one CRC-32 per layer (`layerlift.linker.integrity`: seeded with the key and
the layer, so a foreign object or a swapped slice fails too). Plain and
synchronous: the worker calls these in its lane's threads (fetches) or on
vLLM's thread (staging an offload).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence

import numpy as np
import torch

from layerlift.hosts.vllm.layout import GroupLayout, Layout
from layerlift.linker.integrity import CHECK_BYTES, checksums, mismatches, slice_seed
from layerlift.linker.scratch import Scratch
from layerlift.linker.store_base import Store, StoreError, StoreIntegrityError, StoreTimeout

__all__ = ["KeyedItem", "LoadRevoked", "block_bytes", "layer_fetch", "release_after",
           "stage_objects"]

# (group index, store key, block id): an item with the key of this worker's rank
KeyedItem = tuple[int, str, int]


class LoadRevoked(StoreError):
    """The load was reported failed before this layer's copy: nothing was written."""


def block_bytes(kv: torch.Tensor, block_id: int) -> torch.Tensor:
    """Block ``block_id`` of a layer's KV tensor as a flat uint8 view."""
    return kv[block_id].view(torch.uint8).view(-1)


def layer_fetch(store: Store, layout: Layout, kv: dict[str, torch.Tensor], group: GroupLayout,
                j: int, items: Sequence[KeyedItem], scratch: Scratch, offsets: Sequence[int],
                gate: Callable[[], threading.Lock | None], timed_out: list[StoreTimeout],
                corrupt: Callable[[list[str]], None]) -> Callable[[], None]:
    """The fetch of layer ``j`` of ``group`` for every item of that group.

    Reads slice ``j`` of each object and its footer entry into staging (one
    ranged call), verifies the CRCs, removes objects that fail (so a later
    offload can replace them) and raises StoreIntegrityError; then copies
    into vLLM's blocks holding ``gate()``'s lock: ``gate()`` returns None
    once the load was reported, and then nothing is copied (LoadRevoked).
    A StoreTimeout is appended to ``timed_out`` before it is raised.
    """
    name = group.layer_names[j]
    slice_off, size = layout.slices(group)[j]
    footer = sum(s for _, s in layout.slices(group)) + CHECK_BYTES * j
    rows = [(i, key, block) for i, (g, key, block) in enumerate(items) if g == group.index]

    def fetch() -> None:
        dst = [scratch.ptr + offsets[i] + slice_off for i, _, _ in rows]
        crc = [offsets[i] + footer for i, _, _ in rows]
        keys = [k for _, k, _ in rows]
        try:
            store.get_ranges(keys, [[d, scratch.ptr + c] for d, c in zip(dst, crc, strict=True)],
                             [[size, CHECK_BYTES]] * len(rows), [[slice_off, footer]] * len(rows))
        except StoreTimeout as exc:
            timed_out.append(exc)
            raise
        raw = scratch.tensor.numpy()
        expected = np.array([int.from_bytes(raw[c:c + CHECK_BYTES].tobytes(), "little")
                             for c in crc], dtype="<u4")
        bad = mismatches(dst, size, expected, [slice_seed(k, j) for k in keys])
        if bad:
            corrupt([keys[b] for b in bad])
            raise StoreIntegrityError(f"{len(bad)} object(s) of {name} failed their checksum, "
                                      f"e.g. {keys[bad[0]]}")
        lock = gate()
        if lock is None:
            raise LoadRevoked("the load was already reported")
        with lock, torch.inference_mode():  # vLLM's caches may be inference tensors
            if gate() is None:
                raise LoadRevoked("the load was already reported")
            for (_, _, block), d in zip(rows, dst, strict=True):
                start = d - scratch.ptr
                block_bytes(kv[name], block).copy_(scratch.tensor[start:start + size])

    return fetch


def stage_objects(layout: Layout, kv: dict[str, torch.Tensor], items: Sequence[KeyedItem],
                  scratch: Scratch) -> tuple[list[int], list[int]]:
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


def release_after(timed_out: Sequence[StoreTimeout], scratch: Scratch) -> None:
    """Release ``scratch`` once every timed-out call lent it has ended (in a
    daemon thread when one still runs: a master that resumes late writes
    into staging nobody else holds)."""
    if not timed_out:
        scratch.release()
        return

    def wait() -> None:
        for exc in timed_out:
            exc.wait_finished(None)
        scratch.release()

    threading.Thread(target=wait, name="layerlift-vllm-quarantine", daemon=True).start()
