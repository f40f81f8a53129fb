"""The staged transfer: fetch → verify CRC → gated copy (loads); snapshot → put (offloads).

One mechanism for the engine, the SGLang linker and the vLLM worker. It moves
store objects in the format of ``linker/integrity.py`` (a page's layer slices,
layer-major, then one CRC-32C per slice, seeded with the key and the slice's
index) between the store and a host's memory, always through a
:class:`~layerlift.linker.ring.StagingRing`. What the host's memory *is*
(SGLang's slots, vLLM's blocks, the engine's pool pages, device tensors) stays
behind two small seams each adapter supplies: a **sink** (where verified rows
go) and a **snapshot** (where an offload's page bytes come from). Nothing in
here knows a host's vocabulary.

The loads are in ``linker/staged_load.py`` (:class:`StagedLoad` and its
per-layer staged read; what its readers share, its errors among it, in
``load_core.py``; the whole-load reads in ``load_whole.py``; the in-place
reads in ``load_in_place.py``), the offloads in ``linker/staged_offload.py``
(:class:`StagedOffload`); the plain data of a transfer (layouts, parts,
segments, chunks, the packing) in ``linker/transfer_plan.py``; the sinks,
snapshots, placements, sources and the gate in ``linker/sinks.py``. All are
re-exported here: this module is the staged transfer's public face, and
this docstring its overview.

Loads (:class:`StagedLoad`)
===========================

``fetch_layer(layer)`` (a worker thread; :meth:`StagedLoad.job` wraps it as the
``overlap`` scheduler's :class:`~layerlift.overlap.base.LayerJob`) runs the
layer's chunks in order; per chunk:

1. take a region (bounded wait: :class:`~layerlift.linker.ring.StagingTimeout`);
2. one ``get_ranges`` call into the region: each object's slice, and beside
   it, for a part's first slice (``local`` 0) the object's whole footer, for a
   later slice nothing when that first slice's chunk verified the rows'
   footers already (they are kept per row: one range per object, not two),
   else the slice's own footer entry;
3. verify every CRC; on a mismatch raise :class:`CorruptSlices` (``.keys``,
   ``.layer``) *before* anything is copied: a corrupt, foreign or truncated
   slice never reaches the destination (``on_corrupt`` hears the keys first,
   for an adapter that removes them). An object shorter than its layout
   (the store's :class:`~layerlift.linker.store_base.StoreObjectSize`: the
   read of its slice or footer entry lies past its end) is treated the same:
   ``on_corrupt`` hears its keys, then :class:`CorruptSlices`, nothing copied;
4. under the :class:`Gate`: if it is closed raise :class:`TransferRevoked` (no
   copy); else, per segment, ``sink.write(segment, part, rows)`` with
   ``rows`` the verified ``uint8[n, size]`` view of the region;
   After the layer's last chunk was written, still under the gate,
   ``on_layer(layer, event)`` runs: an adapter marks the layer landed there,
   so a ``gate.close()`` that returned sees every layer either landed (all
   its copies issued) or never to land (its slots may be zeroed safely);
5. give the region back: at once when the sink returned None (the copy is
   done), or once the event the sink returned completed
   (:meth:`Region.release_after`): staging is reused only after the device
   copy that reads it ran.

It returns the layer's event (the last chunk's; None on the host path) and
stores it in ``events[layer]``. A failure raises out of ``fetch_layer`` (the
scheduler then fails the layer and later ones); chunks of the layer already
copied stay copied: the adapter zeroes or reports the layer as failed, as it
does today.

``StoreTimeout`` of a read: the region is handed over to the still-running
call (:meth:`Region.hand_over`: it returns to the ring only when the call
ended, so a late landing writes staging that is still owned, never the
destination and never a region lent to someone else), the exception is
marked owned and appended to ``timed_out``, and it is raised. Cancellation:
a load is stopped by closing its gate (``gate.close()``, e.g. when the load is
reported failed or the request aborted); from then on nothing is written into
the destination; reads in flight finish into staging and their regions
return. The adapter frees the destination only after ``gate.close()``
returned, and the staging's memory (the ring) only once ``wait_quiet`` is
true. The transfer opens no read session: the adapter opens one over the
load's keys around it (``Store.open_session``), as it does today.

Whole (:meth:`StagedLoad.fetch_all`)
====================================

For a load nobody waits on layer by layer (the vLLM worker's asynchronous
restores: the request waits for all of it), the layers' segments are packed
together, in layer order, into chunks of the same budget: a load within one
chunk is one ``get_ranges`` for every layer. Each chunk goes through steps
1-5 as one: nothing of it is copied unless every slice in it verified; a
layer lands once the chunk holding its last slice was copied. Into a host
or a device sink, a load of several chunks reads ``depth`` of them at once,
on threads of the call, and lands its layers in chunk order after them (on
a device with an event recorded after every copy issued by then,
:meth:`DeviceSink.mark`: the chunks' copies reach the stream in the order
their threads finish); the first failure halts the rest (no chunk begins,
none still reading copies), and the call returns once every thread of it
returned.
:meth:`StagedLoad.all_jobs` gives it to a streamed scheduler unit (one
thread, the jobs in order: the first reads everything, the others return
once their layer is in).

In place (the engine's loads, vLLM's worker's host restores)
=============================================================

With a :class:`Placement` instead of a sink, a layer is one chunk (one
``get_ranges`` call, whatever its size: the engine's "one store call per
layer, all requests together"; or, with ``in_place_ranges``, as few calls
as keep each within that many ranges, the layer landing after its last)
whose slices land straight in the placement's registered memory (the
engine's pool pages, or its pinned per-batch staging on a device; vLLM's
host blocks; SGLang's host slots, where a slice lands in pieces, its K rows
and its V rows: ``Placement.pieces``, one range each, the CRC over the
pieces in order); only the checks of step 2 go through the
ring, in a region that never waits (``overflow``). Step 3 verifies the
slices where they landed: a corrupt slice is in the destination then, and
:class:`CorruptSlices` tells the adapter to treat the layer as not
restored (the engine recomputes it; its pages were never visible). Step 4
has no copy: the gate is looked at before the read and held while
``on_layer`` runs; from that look until the layer landed (or failed) the
read counts in the gate's reads in flight (``Gate.reading``): closing the
gate cannot revoke a read already issued, so an adapter that cannot keep
the destination (vLLM's blocks) hands it back only once ``Gate.wait_reads``
returned True (or from ``Gate.when_quiet``). A ``StoreTimeout`` hands the
checks' region over, as above, and ``placement.timed_out`` takes the
destination over (the engine pins the pages the call may still write;
vLLM's worker and SGLang's linker count the call in flight until it
ended, ``Gate.keep_until``; a call lent no memory, ``StoreTimeout.lent``
False, a session start, is not counted). ``verify=False`` reads the slices
alone (the engine's ``verify_restores=False``, a negative control).
:meth:`StagedLoad.fetch_whole` is the barrier's read in place: every object
whole (page and footer) in one call, then every slice verified.

Offloads (:class:`StagedOffload`)
=================================

``run()`` (a worker thread) per chunk, in order: take a region, let the
snapshot copy each segment's page bytes into it (``snapshot.read(segment,
part, pages)``, ``pages`` the ``uint8[n, page_bytes]`` strided view of the
region's rows), compute the footers over *those* bytes (or take the ones the
snapshot computed over them as it copied each slice: a host snapshot reads
each slice back from the cache instead of the chunk again from memory,
``integrity.copy_checksum``), then one ``put``. The bytes a
put sends are the snapshot's, under checksums of the same bytes: a put that
lands late (after its timeout) sends what the source held at snapshot time,
never what it holds later. ``on_source_free`` runs once the transfer will not
read the source again (after the last snapshot, or at the first failure): the
adapter keeps its source (locked slots, pinned pages, blocks not freed) until
then. The outcome is an :class:`OffloadOutcome` (objects and bytes put, late
landings, the first error); a failure stops the offload (later chunks are not
sent).

In place (the engine's offloads): with a :class:`Source` instead of a
snapshot, the objects go in ``put_parts`` calls growing from 8 MiB (the
hosts' in-place pipeline, ``linker/in_place.py``: in order, the next calls'
footers computed while one runs, the first failure ends it), each page from where
it is (the engine's pinned pool pages, or its registered host copy of
device pages), its footer computed over those very bytes into a region of
the ring that never waits (``overflow``); the adapter keeps the pages
unchanged until ``run`` returned, and a put that timed out is always waited
for (``wait_timed_out``). A page no layer reads (an :class:`ObjectLayout`
without slices) is put without a footer.

``StoreTimeout`` of a put: with ``wait_timed_out`` (the engine's rule) the
worker waits until the put really ended; if it succeeded it counts as
``late`` and the offload goes on, else the offload fails. Without it (the
hosts' rule: report at once) the region is handed over to the call, the
offload fails at once with that ``StoreTimeout``, and ``on_late_end`` runs
when the call ended.
"""

from __future__ import annotations

from layerlift.linker.sinks import (
    DeviceSink,
    DeviceSnapshot,
    Gate,
    HostSink,
    HostSnapshot,
    Placement,
    Sink,
    Snapshot,
    Source,
)
from layerlift.linker.staged_load import DEFAULT_DEPTH, CorruptSlices, StagedLoad, TransferRevoked
from layerlift.linker.staged_offload import OffloadOutcome, StagedOffload
from layerlift.linker.transfer_plan import (
    LoadChunk,
    LoadPart,
    LoadSegment,
    ObjectLayout,
    OffloadChunk,
    OffloadPart,
    OffloadSegment,
    require_fit,
)

__all__ = [
    "DEFAULT_DEPTH",
    "CorruptSlices",
    "DeviceSink",
    "DeviceSnapshot",
    "Gate",
    "HostSink",
    "HostSnapshot",
    "LoadChunk",
    "LoadPart",
    "LoadSegment",
    "ObjectLayout",
    "OffloadChunk",
    "OffloadOutcome",
    "OffloadPart",
    "OffloadSegment",
    "Placement",
    "Sink",
    "Snapshot",
    "Source",
    "StagedLoad",
    "StagedOffload",
    "TransferRevoked",
    "require_fit",
]
