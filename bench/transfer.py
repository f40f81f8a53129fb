"""The transfer benchmark: LayerLift's staged transfer against raw Mooncake, at a real size.

    layerlift bench transfer [--tokens 8192] [--page-sizes 16,64,128] [--repeats 5]
                             [--netns RATE ...] [--json PATH] [--markdown PATH]

A real model's KV layout (default 32 layers x 8 KV heads x 128 head dim,
bf16, K+V: 4 KiB per token per layer, 128 KiB per token) for a prompt of
``--tokens`` tokens, one page object per page (layer-major, then the
per-layer CRC-32C footer: LayerLift's object format), moved between a client
with no segment of its own and the store's segment. Loads, every mode over
the same objects into the same registered destination:

* ``raw whole``: batch ``get`` calls of whole objects, 256 MiB a call (the
  ceiling; one call of every object would outlive the master's 5 s read
  lease over a 1 Gbit link);
* ``raw ranged dD``: one ``get_ranges`` per layer (each object's slice, no
  checksum), D layers in flight, inside one read session: the store's own
  speed for a per-layer load;
* ``in-place dD``: the engine's load: one :class:`StagedLoad` with a
  placement (each layer's slices straight into the destination, footers once,
  every slice's CRC verified where it landed), its layer jobs issued by
  LayerLift's ``LoadScheduler`` on a ``CpuLane`` of D workers;
* ``ring dD``: the hosts' load (SGLang's linker, vLLM's worker): the same
  ``StagedLoad`` through a 64 MiB staging ring into a ``HostSink`` (fetch into
  staging, verify, copy into the destination), ``depth`` D.

Offloads, from one registered source of the same pages, each repeat under
new keys: ``raw put`` (whole objects, footers precomputed), ``in-place`` (the
engine's: one ``put_parts`` of every page from where it is, footers computed
over those bytes) and ``ring`` (the hosts': snapshot into a 128 MiB
staging ring, SGLang's offload default, footers, put, chunk by chunk: 64 MiB
puts, each beside the staging of the next).

Every figure is GB/s of payload (page bytes, no footers) as min / median /
max over the repeats, modes rotated per repeat; ``/ ranged`` is the median
of the per-repeat ratios to the raw ranged read at the same depth (loads)
or to the raw put (offloads), and ``/ whole`` to the first row. The
``profile`` rows split one more sequential (d1) run of each LayerLift mode:
time inside store calls, CRC checks, copies, ring waits, session calls and
the rest (Python bookkeeping), per layer and per slice. ``cores`` is the
process's CPU time over the wall time of each mode (what it kept busy),
``machine`` the cores busy on the whole machine meanwhile (``machine_cpu``:
the storage node of a namespace link and the kernel's work too; on two
cores a mode at ~2 leaves nothing to overlap). ``--netns RATE``
runs the same on a third namespace host behind a ``tbf`` link of RATE (the
master and a storage node on hosts of their own).
"""

from __future__ import annotations

import argparse
import asyncio
import ctypes
import json
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
import torch

from layerlift.bench import machine_cpu, thread_cpu
from layerlift.bench.args import BenchParser, int_at_least, int_list
from layerlift.bench.netns_link import add_link_options, per_link
from layerlift.bench.output import add_output_options, write_outputs
from layerlift.bench.results import plot, render
from layerlift.bench.stats import spread
from layerlift.bench.transfer_profile import profiled
from layerlift.bench.transfer_report import (
    RAW_CHECKED,
    RAW_LOAD,
    RAW_PUT,
    plot_record,
    render_table,
)
from layerlift.linker.integrity import copy_checksum, footers, mismatches, slice_seed
from layerlift.linker.master import EmbeddedMaster
from layerlift.linker.mooncake_config import MooncakeConfig
from layerlift.linker.mooncake_store import MooncakeStore
from layerlift.linker.ring import DEFAULT_RING_BYTES, StagingRing
from layerlift.linker.staged import (
    HostSink,
    LoadPart,
    LoadSegment,
    ObjectLayout,
    OffloadPart,
    OffloadSegment,
    StagedLoad,
    StagedOffload,
)
from layerlift.linker.store_base import Store, StoreObjectLeased, StoreTimeout
from layerlift.overlap.base import LoadPolicy
from layerlift.overlap.lanes import CpuLane
from layerlift.overlap.readiness import LayerReadiness
from layerlift.overlap.scheduler import LoadScheduler

__all__ = ["Clock", "Layout", "Step", "build_parser", "main", "measure", "plot_record", "render_table"]

DEPTHS = (1, 4)
OFFLOAD_RING_BYTES = 2 * DEFAULT_RING_BYTES  # SGLang's offload_staging_mib default
WHOLE_CALL_BYTES = 256 << 20  # a raw whole read's batch: 2 s at 1 Gbit, under the 5 s lease
LEASE_WAIT_S = 20.0  # how long a case's objects may stay leased after its last read


class Layout:
    """A real model's KV page object: ``layers`` slices of K+V for ``page``
    tokens, then the footer."""

    def __init__(self, layers: int, kv_heads: int, head_dim: int, dtype_bytes: int,
                 page: int) -> None:
        self.layers, self.page = layers, page
        self.slice = 2 * page * kv_heads * head_dim * dtype_bytes
        self.objects = ObjectLayout(tuple((j * self.slice, self.slice) for j in range(layers)),
                                    layers * self.slice)

    @property
    def page_bytes(self) -> int:
        return self.objects.page_bytes

    @property
    def object_bytes(self) -> int:
        return self.objects.object_bytes




class Step(NamedTuple):
    """One timed step of a host transfer benchmark's unit: its GB/s, the
    cores this process kept busy (its CPU time over the wall time, every
    thread), the cores busy on the whole machine meanwhile
    (:mod:`machine_cpu`; None where ``/proc/stat`` was not read or no tick
    passed) and the process's cores by kind of thread (:mod:`thread_cpu`;
    None where they were not read)."""

    gbps: float
    cores: float
    machine: float | None
    threads: dict[str, float] | None = None


class Clock:
    """Wall and CPU time of one step since its start (now, or the given
    clock readings), and the machine's CPU counters and this process's
    threads' then (read now when the readings are not given, else
    ``machine`` and no threads'): ``stop(nbytes)`` is its :class:`Step`;
    ``lap()`` the readings for a byte count known later."""

    def __init__(self, wall: float | None = None, cpu: float | None = None,
                 machine: machine_cpu.CpuSample | None = None) -> None:
        self.machine = machine_cpu.sample() if wall is None else machine
        self.threads = thread_cpu.sample() if wall is None else None
        self.wall = time.perf_counter() if wall is None else wall
        self.cpu = time.process_time() if cpu is None else cpu

    def elapsed(self) -> tuple[float, float]:
        """Wall and CPU seconds since the start."""
        return time.perf_counter() - self.wall, time.process_time() - self.cpu

    def lap(self) -> Callable[[int], Step]:
        """The readings now, as the step of a byte count given later."""
        wall, cpu = self.elapsed()
        busy = machine_cpu.cores(self.machine, machine_cpu.sample())
        threads = thread_cpu.cores(self.threads, thread_cpu.sample(), wall)
        return lambda nbytes: Step(nbytes / wall / 1e9, cpu / wall, busy, threads)

    def stop(self, nbytes: int) -> Step:
        return self.lap()(nbytes)


def _require(ok: object, what: str) -> None:
    """A measured run that did not do its job ends the benchmark (also under ``-O``)."""
    if not ok:
        raise RuntimeError(f"bench transfer: {what}")


class _Rows:
    """Row ``i`` (one object) of a registered ``uint8[n, object_bytes]`` tensor."""

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor = tensor
        self.base, self.stride = int(tensor.data_ptr()), int(tensor.stride(0))

    def ptr(self, i: int) -> int:
        return self.base + i * self.stride


class _Placement:
    """The engine's in-place destination: slice ``local`` of row ``i`` lands at
    its offset in row ``i`` of the destination."""

    def __init__(self, rows: _Rows, layout: Layout) -> None:
        self.rows, self.layout = rows, layout

    def pieces(self, part: LoadPart, local: int) -> tuple[int, ...]:
        return (part.layout.slices[local][1],)

    def addresses(self, seg: LoadSegment, part: LoadPart) -> list[int]:
        at = self.layout.objects.slices[seg.local][0]
        return [self.rows.ptr(i) + at for i in range(seg.lo, seg.hi)]

    def pages(self, part: LoadPart) -> list[int]:
        return [self.rows.ptr(i) for i in range(len(part.keys))]

    def timed_out(self, part: LoadPart, lo: int, hi: int, exc: StoreTimeout) -> None:
        exc.wait_finished()  # the benchmark's memory outlives the call


class _RowSnapshot:
    """The hosts' snapshot on CPU (SGLang's): each row's page bytes copied
    into staging slice by slice with memmove, each slice checksummed right
    after its copy (``copy_checksum``); the footers are returned."""

    def __init__(self, rows: _Rows, page_bytes: int) -> None:
        self.rows, self.page_bytes = rows, page_bytes

    def read(self, seg: OffloadSegment, part: OffloadPart, pages: torch.Tensor) -> np.ndarray:
        slices = part.layout.slices
        _require(sum(n for _, n in slices) == self.page_bytes, "the slices tile the page")
        base, stride = int(pages.data_ptr()), int(pages.stride(0))
        table = np.empty((seg.rows, len(slices)), dtype="<u4")
        for i in range(seg.rows):
            dst, src = base + i * stride, self.rows.ptr(seg.lo + i)
            key = part.keys[seg.lo + i]
            for j, (o, n) in enumerate(slices):
                table[i, j] = copy_checksum(dst + o, [(src + o, n)], slice_seed(key, j))
        return table


class _Source:
    def __init__(self, rows: _Rows) -> None:
        self.rows = rows

    def pages(self, seg: OffloadSegment, part: OffloadPart) -> list[int]:
        return [self.rows.ptr(i) for i in range(seg.lo, seg.hi)]


class Bench:
    """Every mode of one page size over ``n`` objects (see the module docstring)."""

    def __init__(self, store: Store, layout: Layout, tokens: int, timeout_s: float) -> None:
        self.store, self.layout = store, layout
        self.n = max(1, tokens // layout.page)
        self.timeout_s = timeout_s
        run = uuid.uuid4().hex[:8]
        self.keys = tuple(f"bench-transfer-{run}/ps{layout.page}/{i}" for i in range(self.n))
        ob = layout.object_bytes
        gen = torch.Generator().manual_seed(layout.page)
        self.src = torch.randint(0, 256, (self.n, ob), dtype=torch.uint8, generator=gen)
        self.dst = torch.zeros(self.n, ob, dtype=torch.uint8)
        store.register(self.src)
        store.register(self.dst)
        self.src_rows, self.dst_rows = _Rows(self.src), _Rows(self.dst)
        self._footers(self.src, self.keys)
        self.ring = StagingRing(store, DEFAULT_RING_BYTES, timeout_s=timeout_s)
        # The hosts' offload ring: SGLang's default offload_staging_mib (twice
        # its load ring), so an offload puts in chunks of half of it.
        self.offload_ring = StagingRing(store, OFFLOAD_RING_BYTES, timeout_s=timeout_s)
        store.put(list(self.keys), [self.src_rows.ptr(i) for i in range(self.n)], [ob] * self.n)
        self.pool = ThreadPoolExecutor(max(DEPTHS))
        self._keys_made: list[str] = []

    def close(self) -> None:
        self.pool.shutdown()
        self.ring.close()
        self.offload_ring.close()
        for t in (self.src, self.dst):
            self.store.unregister(int(t.data_ptr()))
        self.remove_keys(list(self.keys) + self._keys_made)

    def remove_keys(self, keys: list[str]) -> None:
        """Remove ``keys`` (the next case needs the segment), waiting out the
        read lease of those just read (``layerlift master``'s is 5 s)."""
        deadline = time.monotonic() + LEASE_WAIT_S
        while keys:
            try:
                self.store.remove(keys)
                return
            except StoreObjectLeased as exc:
                keys = list(exc.keys)
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.25)  # the master's lease expires on its own clock

    def raw_rows(self, put_store: Store, *, before_put: Callable[[], None] = lambda: None
                 ) -> dict[str, Step]:
        """The host transfer benchmarks' raw rows: ``raw ranged d4`` and
        ``raw ranged d4 + check`` (:meth:`raw_ranged` with its check; each one's
        destination checked, then cleared), ``before_put()``, then ``raw
        put`` of every object from ``put_store`` under new keys (removed
        after: never read); each a :class:`Step`."""
        clock = Clock()
        self.raw_ranged(4)
        load = clock.stop(self.payload)
        self.check()
        self.dst.zero_()
        clock = Clock()
        self.raw_ranged(4, check=True)
        checked = clock.stop(self.payload)
        self.check()
        self.dst.zero_()
        before_put()
        keys = [f"bench-transfer-raw-put-{uuid.uuid4().hex[:8]}/{i}" for i in range(self.n)]
        clock = Clock()
        put_store.put(keys, [self.src_rows.ptr(i) for i in range(self.n)],
                      [self.layout.object_bytes] * self.n)
        put = clock.stop(self.payload)
        put_store.remove(keys)
        return {RAW_LOAD: load, RAW_CHECKED: checked, RAW_PUT: put}

    def remove_objects(self) -> None:
        """Remove the load modes' objects (waiting out their read lease)."""
        self.remove_keys(list(self.keys))

    def reput(self) -> None:
        """Put the load modes' objects again (after :meth:`remove_objects`,
        or a client that empties the store, as ``bench transfer-sglang``'s
        sweeps do)."""
        self.remove_keys(list(self.keys))
        ob = self.layout.object_bytes
        self.store.put(list(self.keys), [self.src_rows.ptr(i) for i in range(self.n)],
                       [ob] * self.n)

    def _footers(self, rows: torch.Tensor, keys: Sequence[str]) -> None:
        """Write each row's footer for ``keys`` (LayerLift's object format)."""
        objects, pb = self.layout.objects, self.layout.page_bytes
        base, stride = int(rows.data_ptr()), int(rows.stride(0))
        table = footers([base + i * stride for i in range(len(keys))], objects.slices, keys)
        rows.numpy()[:, pb : pb + objects.footer_bytes] = table.view(np.uint8)

    @property
    def payload(self) -> int:
        return self.n * self.layout.page_bytes

    # ---- loads ---------------------------------------------------------------------
    def raw_whole(self) -> None:
        """Whole objects, ``WHOLE_CALL_BYTES`` a batch ``get`` (one call of
        every object outlives Mooncake's read lease over a 1 Gbit link)."""
        ob = self.layout.object_bytes
        per = max(1, WHOLE_CALL_BYTES // ob)
        for lo in range(0, self.n, per):
            hi = min(self.n, lo + per)
            ok = self.store.get(list(self.keys[lo:hi]),
                                [self.dst_rows.ptr(i) for i in range(lo, hi)], [ob] * (hi - lo))
            _require(all(ok), "a whole read failed")

    def raw_ranged(self, depth: int, *, check: bool = False) -> None:
        """One ``get_ranges`` per layer (each object's slice), ``depth``
        layers in flight, inside one read session. ``check`` (``raw ranged
        d4 + check``: LayerLift's check and nothing else): every object's
        footer first (one call, into its row), then each layer's slices
        verified against their entries by the thread that read them (no
        staging, no copy, no scheduler); a corrupt slice ends the benchmark."""
        keys, lay, n = list(self.keys), self.layout, self.n
        pb, fb = lay.page_bytes, lay.objects.footer_bytes
        sizes = [[lay.slice]] * n
        table = self.dst[:, pb : pb + fb].numpy().view("<u4")  # each row's footer, once read

        def layer(j: int) -> None:
            at = j * lay.slice
            ptrs = [self.dst_rows.ptr(i) + at for i in range(n)]
            self.store.get_ranges(keys, [[p] for p in ptrs], sizes, [[at]] * n)
            if check:
                bad = mismatches(ptrs, lay.slice, table[:, j], [slice_seed(k, j) for k in keys])
                _require(not bad, f"a checked raw read found {len(bad)} corrupt slices")

        with self.store.open_session(keys):
            if check:
                self.store.get_ranges(keys, [[self.dst_rows.ptr(i) + pb] for i in range(n)],
                                      [[fb]] * n, [[pb]] * n)
            if depth == 1:
                for j in range(lay.layers):
                    layer(j)
            else:
                list(self.pool.map(layer, range(lay.layers)))

    def _staged(self, *, in_place: bool, depth: int) -> StagedLoad:
        part = LoadPart(self.layout.objects, self.keys)
        reads = [[(0, j)] for j in range(self.layout.layers)]
        if in_place:
            return StagedLoad(self.ring, self.store, [part], reads, None, depth=depth,
                              timeout_s=self.timeout_s,
                              placement=_Placement(self.dst_rows, self.layout))
        dst, size = self.dst_rows, self.layout.slice

        def scatter(seg: LoadSegment, part: LoadPart, rows: torch.Tensor) -> None:
            # As the hosts' CPU paths copy: one memmove a row (no torch
            # intra-op threads competing with the store's for the cores).
            at = seg.local * size
            src, stride = int(rows.data_ptr()), int(rows.stride(0))
            for i in range(seg.rows):
                ctypes.memmove(dst.ptr(seg.lo + i) + at, src + i * stride, size)

        return StagedLoad(self.ring, self.store, [part], reads, HostSink(scatter), depth=depth,
                          timeout_s=self.timeout_s)

    def staged(self, *, in_place: bool, depth: int) -> None:
        """One load as a host issues it: the layer jobs on LayerLift's
        scheduler and a CpuLane of ``depth`` workers, inside one session."""
        load = self._staged(in_place=in_place, depth=depth)
        jobs = [load.job(j) for j in range(self.layout.layers)]

        async def run() -> LayerReadiness:
            lane = CpuLane(max_workers=depth, name="bench")
            try:
                readiness = LayerReadiness(self.layout.layers, default_timeout=self.timeout_s)
                task = LoadScheduler(lane, LoadPolicy.OVERLAP, max_in_flight=depth).start(
                    jobs, readiness)
                await task.wait_quiescent()
                return readiness
            finally:
                lane.close()

        with self.store.open_session(list(self.keys)):
            readiness = asyncio.run(run())
        errors = {str(readiness.error(j)) for j in range(self.layout.layers)
                  if readiness.failed(j)}
        _require(readiness.all_done(), f"a staged load failed ({'; '.join(sorted(errors))})")
        _require(load.wait_quiet(self.timeout_s), "a staged load did not go quiet")

    def profile_load(self, *, in_place: bool) -> dict[str, Any]:
        """One sequential run (depth 1, this thread), split by where the time went."""
        load = self._staged(in_place=in_place, depth=1)
        with profiled(self.store, self.ring) as prof, \
                self.store.open_session(list(self.keys)):
            for j in range(self.layout.layers):
                load.fetch_layer(j)
        return prof.split(self.layout.layers, self.n * self.layout.layers)

    def check(self) -> None:
        """The destination holds the source's pages (every load mode writes them)."""
        pb = self.layout.page_bytes
        _require(torch.equal(self.dst[:, :pb], self.src[:, :pb]), "a load wrote wrong bytes")

    # ---- offloads ------------------------------------------------------------------
    def _new_keys(self) -> tuple[str, ...]:
        run = uuid.uuid4().hex[:8]
        keys = tuple(f"bench-transfer-put-{run}/ps{self.layout.page}/{i}" for i in range(self.n))
        self._keys_made += keys
        return keys

    def raw_put(self) -> None:
        keys, ob = self._new_keys(), self.layout.object_bytes
        self.store.put(list(keys), [self.src_rows.ptr(i) for i in range(self.n)], [ob] * self.n)
        self._forget(keys)

    def offload(self, *, in_place: bool) -> None:
        keys = self._new_keys()
        part = OffloadPart(self.layout.objects, keys)
        if in_place:
            off = StagedOffload(self.ring, self.store, [part], None, timeout_s=self.timeout_s,
                                wait_timed_out=True, source=_Source(self.src_rows))
        else:
            off = StagedOffload(self.offload_ring, self.store, [part],
                                _RowSnapshot(self.src_rows, self.layout.page_bytes),
                                timeout_s=self.timeout_s)
        outcome = off.run()
        _require(outcome.ok, f"an offload failed: {outcome}")
        self._forget(keys)

    def profile_offload(self, *, in_place: bool) -> dict[str, Any]:
        ring = self.ring if in_place else self.offload_ring
        with profiled(self.store, ring, (_RowSnapshot,)) as prof:
            self.offload(in_place=in_place)
        return prof.split(self.layout.layers, self.n * self.layout.layers)

    def _forget(self, keys: Sequence[str]) -> None:
        self.remove_keys(list(keys))  # never read: no lease
        self._keys_made = self._keys_made[: -len(keys)]


def _modes(b: Bench) -> tuple[dict[str, Callable[[], None]], dict[str, Callable[[], None]]]:
    loads: dict[str, Callable[[], None]] = {"raw whole": b.raw_whole}
    for d in DEPTHS:
        loads[f"raw ranged d{d}"] = partial(b.raw_ranged, d)
        loads[f"in-place d{d}"] = partial(b.staged, in_place=True, depth=d)
        loads[f"ring d{d}"] = partial(b.staged, in_place=False, depth=d)
    offloads: dict[str, Callable[[], None]] = {
        "raw put": b.raw_put,
        "in-place": partial(b.offload, in_place=True),
        "ring": partial(b.offload, in_place=False),
    }
    return loads, offloads


def _timed(modes: dict[str, Callable[[], None]], repeats: int, after: Callable[[], None],
           nbytes: int) -> tuple[dict[str, list[float]], dict[str, list[float]],
                                 dict[str, list[float]]]:
    """GB/s of every repeat of every mode (rotated per repeat), the cores
    this process kept busy meanwhile (its CPU time over the wall time, every
    thread: the store's own transfer threads included), and the cores busy
    on the whole machine (`machine_cpu`: other processes and the kernel's
    work too; empty where it cannot be read)."""
    names = list(modes)
    gbps: dict[str, list[float]] = {m: [] for m in names}
    cores: dict[str, list[float]] = {m: [] for m in names}
    machine: dict[str, list[float]] = {m: [] for m in names}
    for rep in range(repeats):
        for mode in names[rep % len(names):] + names[: rep % len(names)]:
            clock = Clock()
            modes[mode]()
            step = clock.stop(nbytes)
            gbps[mode].append(step.gbps)
            cores[mode].append(step.cores)
            if step.machine is not None:
                machine[mode].append(step.machine)
            after()
    return gbps, cores, {m: v for m, v in machine.items() if len(v) == repeats}


def _ratios(gbps: dict[str, list[float]], base: Callable[[str], str]) -> dict[str, Any]:
    return {m: spread([x / y for x, y in zip(v, gbps[base(m)], strict=True)])
            for m, v in gbps.items()}


def _ranged_of(mode: str) -> str:
    return f"raw ranged d{mode.rsplit('d', 1)[1]}" if mode[-2:-1] == "d" else "raw whole"


def measure(store: Store, layout: Layout, tokens: int, repeats: int,
            timeout_s: float) -> dict[str, Any]:
    """Every mode of one page size: GB/s, ratios, profiles."""
    b = Bench(store, layout, tokens, timeout_s)
    try:
        loads, offloads = _modes(b)
        for run in (*loads.values(), *offloads.values()):  # warm-up: connections, first touch
            run()
        b.check()

        def cleared() -> None:
            b.check()
            b.dst[:, : layout.page_bytes].zero_()

        load_gbps, load_cores, load_machine = _timed(loads, repeats, cleared, b.payload)
        off_gbps, off_cores, off_machine = _timed(offloads, repeats, lambda: None, b.payload)
        profile = {"in-place load": b.profile_load(in_place=True),
                   "ring load": b.profile_load(in_place=False),
                   "in-place offload": b.profile_offload(in_place=True),
                   "ring offload": b.profile_offload(in_place=False)}
        b.check()
    finally:
        b.close()
    return {
        "objects": b.n, "object_bytes": layout.object_bytes, "slice_bytes": layout.slice,
        "payload_bytes": b.payload, "repeats": repeats,
        "loads": {m: spread(v) for m, v in load_gbps.items()},
        "loads / ranged": _ratios(load_gbps, _ranged_of),
        "loads / whole": _ratios(load_gbps, lambda m: "raw whole"),
        "loads cores": {m: spread(v) for m, v in load_cores.items()},
        "loads machine cores": {m: spread(v) for m, v in load_machine.items()},
        "offloads": {m: spread(v) for m, v in off_gbps.items()},
        "offloads / raw put": _ratios(off_gbps, lambda m: "raw put"),
        "offloads cores": {m: spread(v) for m, v in off_cores.items()},
        "offloads machine cores": {m: spread(v) for m, v in off_machine.items()},
        "profile": profile,
    }  # fmt: skip


def run_all(store: Store, args: argparse.Namespace) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for tokens in args.tokens:
        for ps in args.page_sizes:
            layout = Layout(args.layers, args.kv_heads, args.head_dim, 2, ps)
            label = f"{tokens} tokens, page {ps}"
            print(f"  {label}: {max(1, tokens // ps)} objects of "
                  f"{layout.object_bytes / 2**20:.1f} MiB", flush=True)
            out[label] = {"tokens": tokens, "page": ps,
                          **measure(store, layout, tokens, args.repeats, args.timeout)}
    return out


def _segment(args: argparse.Namespace) -> int:
    biggest = max(args.tokens) * args.layers * 2 * args.kv_heads * args.head_dim * 2
    return int(2.5 * biggest) + (256 << 20)  # the loads' objects, a put in flight, slack


def run_loopback(args: argparse.Namespace) -> dict[str, Any]:
    with EmbeddedMaster(lease_ttl_ms=5000, http_metadata=False) as master:
        writer = MooncakeStore(master.config(global_segment_size=_segment(args),
                                             timeout_s=args.timeout))
        reader = MooncakeStore(master.config(global_segment_size=0, local_buffer_size=16 << 20,
                                             timeout_s=args.timeout))
        with writer, reader:
            return run_all(reader, args)


def run_cluster(master: str, args: argparse.Namespace) -> dict[str, Any]:
    from layerlift.engine.stores import route_source

    client = MooncakeStore(MooncakeConfig(
        master_address=master, local_hostname=route_source(master), global_segment_size=0,
        local_buffer_size=16 << 20, timeout_s=args.timeout))
    with client:
        return run_all(client, args)


def run_netns(rate: str, args: argparse.Namespace, argv: Sequence[str]) -> dict[str, Any]:
    from layerlift.bench.netns_link import engine_host_json, netns_cluster

    with tempfile.TemporaryDirectory(prefix="layerlift-transfer-") as tmp, netns_cluster(
            rate, _segment(args), tmp) as (hosts, master):
        out = Path(tmp) / "transfer.json"
        child = [sys.executable, "-m", "layerlift.bench.transfer", *_child_args(argv),
                 "--cluster", master, "--json", str(out)]
        cases: dict[str, Any] = engine_host_json(hosts, child, tmp, out)["cases"]
        return cases


def _child_args(argv: Sequence[str]) -> list[str]:
    """The grid options of ``argv`` without the link and output options."""
    out, skip = [], False
    for a in argv:
        if skip:
            skip = False
            continue
        if a in ("--netns", "--json", "--markdown", "--plot", "--cluster"):
            skip = True
            continue
        if a.split("=", 1)[0] in ("--netns", "--json", "--markdown", "--plot", "--cluster"):
            continue
        out.append(a)
    return out


def build_parser() -> argparse.ArgumentParser:
    parser = BenchParser("layerlift bench transfer", __doc__.splitlines()[0])
    add_output_options(parser)
    parser.add_argument("--tokens", type=int_list(16, "8192,32768"), default=[8192],
                        help="prompt lengths in tokens, comma-separated (e.g. 8192,32768)")
    parser.add_argument("--page-sizes", type=int_list(1, "16,64,128"), default=[16, 64, 128],
                        help="tokens per page, comma-separated")
    parser.add_argument("--layers", type=int_at_least(1), default=32)
    parser.add_argument("--kv-heads", type=int_at_least(1), default=8)
    parser.add_argument("--head-dim", type=int_at_least(1), default=128)
    parser.add_argument("--repeats", type=int_at_least(1), default=5, help="repeats per mode")
    parser.add_argument("--timeout", type=float, default=120.0,
                        help="the store's timeout per call (s)")
    add_link_options(parser)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    raw = list(sys.argv[1:] if argv is None else argv)
    if args.cluster:
        cases = run_cluster(args.cluster, args)
        if args.json is not None:
            Path(args.json).write_text(json.dumps({"cases": cases}))
        return 0
    links = per_link(None if args.no_loopback else partial(run_loopback, args), args.netns,
                     partial(run_netns, args=args, argv=raw))
    report: dict[str, Any] = {
        "links": links,
        "layout": f"{args.layers} layers x {args.kv_heads} KV heads x {args.head_dim}, bf16, "
                  "K+V, one object per page (layer-major, CRC-32C footer)",
        "timing": "GB/s of page bytes, min/median/max over the repeats, modes rotated per "
                  "repeat; ratios are per-repeat (paired); loads inside one read session",
    }
    record = write_outputs("transfer", report, args, argv, render, plot)
    print(render(record))
    return 0


if __name__ == "__main__":
    sys.exit(main())
