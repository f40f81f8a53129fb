"""In-place loads into SGLang's host pools: slices read straight into the slots.

A staged load (``load.py``) reads each chunk into the ring, verifies it
there and copies it into the slots; an in-place load reads each layer's
slices straight into the slots, a range per part (a unit's K rows and its V
rows, two tensors; a Mamba slot's temporal and conv states) and verifies
them where they landed (the CRC over the parts in object order): no staging
and no copy. Only the checksums go through the ring. The pools are the ones
put in place (``offload_in_place.py``: every part of a unit at least
``in_place_min_kib``), registered with the store once for both; a batch's
other pools stay staged (:func:`split_reads`).

Why it is safe: a store read already issued cannot be revoked, so the
batch's gate counts each read in flight (``Gate.reading``), and a read that
timed out until its call really ended (``Gate.keep_until``, from
:meth:`SlotPlacement.timed_out`). A slice is verified before its layer
lands, and nothing lands after the gate closed, as on the staged path. What
differs is after a failure:

- the unlanded layers' slots are zeroed only once no read is in flight
  (``Gate.when_quiet``), so a read that ends late cannot leave its bytes
  over the zeros; the forward, which goes on over a failed batch's slots, may
  meanwhile read bytes still being written, but SGLang discards what it
  computes for those requests (``finish`` returns False);
- ``finish`` returns only once no read is in flight and the zeroing is done
  (SGLang frees the slots right after a False, and another request may
  write them): at most ``read_end_s``, after which it raises
  :class:`SlotsStillWritten` into SGLang's scheduler rather than hand back
  slots a read may still write. Mooncake ends a transfer after
  ``MC_TRANSFER_TIMEOUT`` (30 s by default) past the store's own bound.
"""

from __future__ import annotations

from collections.abc import Sequence

from layerlift.linker.sinks import Gate
from layerlift.linker.store_base import StoreTimeout
from layerlift.linker.transfer_plan import LoadPart, LoadSegment

__all__ = ["IN_PLACE_RANGES", "READ_END_S", "SlotPlacement", "SlotsStillWritten", "split_reads"]

# A layer's in-place read is cut into calls of at most this many ranges (a
# unit's parts and its check): Mooncake's TCP transport queues 1024
# transfers a peer, a batch reads ``depth`` (4) layers at once, and the
# same client's in-place puts send up to 512 buffers a call
# (``offload_in_place.PUT_BUFFERS``). At page 128 of a real layout (64 units
# a layer, three ranges each) calls of 128 and of 256 ranges loaded at the
# same speed (2.46, 2.55 against 2.37-2.59 GB/s, ``bench transfer-sglang``).
IN_PLACE_RANGES = 128

# How long ``finish`` waits for an in-place read to end after its batch
# failed: Mooncake ends a transfer within ``MC_TRANSFER_TIMEOUT`` (30 s by
# default) past the store's bound; beyond this the linker raises.
READ_END_S = 90.0


class SlotsStillWritten(RuntimeError):
    """A store read into SGLang's slots (an in-place load that failed or
    timed out) did not end within ``read_end_s``: the linker cannot hand
    the batch back (SGLang would free the slots and reuse them while the read
    may still write them), so it raises into SGLang's scheduler instead."""


class SlotPlacement:
    """An in-place load's destination (a ``Placement``, ``linker/sinks.py``):
    SGLang's host pools, registered with the store. A part's target is its
    ``LoadItem`` (``load.py``); slice ``local`` of a unit lands in that
    layer's parts at the unit's first row, one piece each. A read that timed
    out keeps counting in ``gate``'s reads in flight until its call ended."""

    def __init__(self, gate: Gate) -> None:
        self.gate = gate

    def pieces(self, part: LoadPart, local: int) -> tuple[int, ...]:
        return tuple(p.nbytes for p in part.target.layout.layers[local].parts)

    def addresses(self, seg: LoadSegment, part: LoadPart) -> list[int]:
        item = part.target
        spans = item.layout.layers[seg.local].spans()  # read off the tensors once
        return [base + row * row_bytes
                for row in item.rows[seg.lo : seg.hi] for base, row_bytes, _ in spans]

    def pages(self, part: LoadPart) -> list[int]:
        raise ValueError("SGLang's pools keep a unit's layers apart: an object is never read "
                         "whole into them")

    def timed_out(self, part: LoadPart, lo: int, hi: int, exc: StoreTimeout) -> None:
        self.gate.keep_until(exc)


def split_reads(names: Sequence[str], reads: Sequence[Sequence[tuple[int, int]]],
                in_place: frozenset[str]) -> list[bool] | None:
    """Which items of a batch read in place: item ``p`` (its pool's name
    ``names[p]``) when its pool is in ``in_place``; None (the whole batch
    staged) when no item is, or when a layer reads from an item of each kind
    (a layer lands from one load). ``reads[layer]``: its ``(item, slice)``."""
    placed = [name in in_place for name in names]
    if not any(placed):
        return None
    for r in reads:
        if len({placed[p] for p, _ in r}) > 1:
            return None
    return placed
