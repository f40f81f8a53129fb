"""The SGLang adapter's device path, measured: per-layer H2D from pinned staging, the
forward's wait per layer, and per-layer overlap against a whole-batch copy.

Runs on a CUDA device (``--device cuda``) or on the simulated device (``--device
sim``: CPU streams that run late; its figures only check that the benchmark runs, they
measure nothing physical). Needs neither SGLang, vLLM nor Mooncake: the pools are
tensors laid out as SGLang's ``MHATokenToKVPool`` (per layer ``k_buffer``/``v_buffer``
of ``[slots, heads, head_dim]`` bf16), read by the adapter's own layout code; the store
is the in-memory one (objects are offloaded into it by the adapter's host path first).
The load is the linker's own: a :class:`~layerlift.hosts.sglang.load.BatchLoad` on the
device path (``DeviceSink`` on a load stream, one event per layer), issued by
LayerLift's scheduler on a CPU lane (``depth`` layers in flight), through a pinned
staging ring of ``staging_mib``; the forward waits through
:class:`~layerlift.hosts.sglang.load.LoadCounter` on its own stream and runs a compute
stand-in per layer (a spin kernel on CUDA).

Measured (``--repeats`` times each; medians):

* ``h2d``: per layer, the device time of the H2D copy and scatter of the layer's
  rows from pinned staging into the slots (the adapter's ``DeviceSink.write``; timing
  events on the load stream around it), as GB/s;
* ``overlap``: the forward's stall per layer (timing events on the forward stream
  before and after ``wait_until(layer)``), and the whole forward's time, load
  included, from its start to its last layer;
* ``whole``: the same forward after ``wait_until(num_layers - 1)`` before layer 0
  (a whole-batch copy, as SGLang's own path before a CUDA-graph prefill);
* ``compute``: the forward alone (every layer already loaded).

Every run checks that the forward read exactly the stored bytes (``exact``).

    python -m layerlift.bench.device_adapters --device cuda --json out.json
    python -m layerlift.bench.device_adapters --device sim --quick
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from types import SimpleNamespace
from typing import Any

import torch

from layerlift.hosts.sglang.device import DevicePath, gather_units, scatter_units
from layerlift.hosts.sglang.layout import PoolLayout, mha_layers
from layerlift.hosts.sglang.load import BatchLoad, LoadCounter, LoadItem, LoopThread
from layerlift.hosts.sglang.offload import Offloader, OffloadItem
from layerlift.hosts.sglang.quarantine import Quarantine
from layerlift.linker.memory_store import MemoryStore
from layerlift.linker.ring import StagingRing
from layerlift.linker.staged import DeviceSink
from layerlift.overlap.base import LoadPolicy
from layerlift.overlap.device import Device, DeviceEvent
from layerlift.overlap.lanes import CpuLane
from layerlift.overlap.scheduler import LoadScheduler

__all__ = ["Config", "main", "run"]

WAIT_S = 120.0


@dataclass(frozen=True)
class Config:
    device: str = "cuda"
    layers: int = 32
    tokens: int = 4096
    page: int = 64
    heads: int = 8
    head_dim: int = 128
    depth: int = 2
    staging_mib: int = 64
    compute_ms: float = 0.5
    repeats: int = 5
    seed: int = 0

    def __post_init__(self) -> None:
        if self.device not in ("cuda", "sim"):
            raise ValueError(f"--device must be cuda or sim, got {self.device!r}")
        for name in ("layers", "tokens", "page", "heads", "head_dim", "depth",
                     "staging_mib", "repeats"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 1")
        if self.tokens % self.page:
            raise ValueError(f"--tokens ({self.tokens}) must be a whole number of "
                             f"--page ({self.page}) pages")
        if self.compute_ms < 0:
            raise ValueError("--compute-ms must be >= 0")

    @property
    def units(self) -> int:
        return self.tokens // self.page

    @property
    def layer_bytes(self) -> int:
        return 2 * self.tokens * self.heads * self.head_dim * 2  # K and V, bf16


@dataclass
class Result:
    config: dict[str, Any]
    device_name: str
    layer_mib: float
    h2d_gbps: list[float] = field(default_factory=list)  # per layer, median over repeats
    h2d_gbps_median: float = 0.0
    wait_ms: list[float] = field(default_factory=list)  # per layer, median over repeats
    overlap_ms: float = 0.0
    whole_ms: float = 0.0
    compute_ms: float = 0.0
    exact: bool = True
    runs: int = 0

    def markdown(self) -> str:
        c = self.config
        lines = [
            f"SGLang adapter device path on {self.device_name}: {c['layers']} layers x "
            f"{self.layer_mib:.2f} MiB ({c['tokens']} tokens, {c['heads']}x{c['head_dim']} "
            f"bf16 K+V), depth {c['depth']}, {c['staging_mib']} MiB pinned staging, "
            f"{c['compute_ms']} ms compute per layer, {c['repeats']} repeats (medians)",
            "",
            "| figure | value |",
            "| --- | --- |",
            f"| H2D + scatter from pinned staging, per layer (GB/s, median of layers) | "
            f"{self.h2d_gbps_median:.2f} |",
            f"| forward's wait per layer (ms): first, median, max | "
            f"{self.wait_ms[0]:.3f}, {statistics.median(self.wait_ms):.3f}, "
            f"{max(self.wait_ms):.3f} |",
            f"| forward with per-layer waits (ms, load included) | {self.overlap_ms:.2f} |",
            f"| forward after a whole-batch wait (ms, load included) | {self.whole_ms:.2f} |",
            f"| forward alone (ms) | {self.compute_ms:.2f} |",
            f"| saved by per-layer overlap (ms) | {self.whole_ms - self.overlap_ms:.2f} |",
            f"| every forward read the stored bytes | {self.exact} ({self.runs} runs) |",
        ]
        return "\n".join(lines)


class _Rig:
    """The device, its compute stand-in and a median helper."""

    def __init__(self, cfg: Config) -> None:
        self.cfg = cfg
        self.sim: Any = None
        self.device: Device
        if cfg.device == "cuda":
            from layerlift.overlap.device import CudaDevice

            self.device = CudaDevice()
            self.name = torch.cuda.get_device_name(self.device.torch_device)
            self._cycles_per_ms = self._calibrate()
        else:
            from layerlift.testing.simdevice import SimDevice

            self.sim = SimDevice(seed=cfg.seed, max_delay_s=0.0005)
            self.device = self.sim
            self.name = "the simulated device (CPU; not a measurement)"
            self._cycles_per_ms = 0.0

    def _calibrate(self) -> float:
        stream = self.device.new_stream()
        start, end = self.device.event(timing=True), self.device.event(timing=True)
        cycles = 10_000_000
        start.record(stream)
        self.device.launch(stream, lambda: torch.cuda._sleep(cycles))  # type: ignore[no-untyped-call]
        end.record(stream)
        end.synchronize()
        return cycles / max(start.elapsed_time(end), 1e-3)

    def compute(self, stream: Any) -> None:
        """One layer's compute stand-in on ``stream``."""
        ms = self.cfg.compute_ms
        if ms <= 0:
            return
        if self._cycles_per_ms:
            cycles = int(ms * self._cycles_per_ms)
            self.device.launch(stream, lambda: torch.cuda._sleep(cycles))  # type: ignore[no-untyped-call]
        else:
            self.device.launch(stream, lambda: time.sleep(ms / 1e3))  # the sim's "kernel"

    def close(self) -> None:
        if self.sim is not None:
            self.sim.close()


def _pool(cfg: Config, device: torch.device, seed: int | None) -> PoolLayout:
    """A pool shaped like SGLang's ``MHATokenToKVPool`` (random bytes, or zeros)."""
    slots = cfg.tokens + cfg.page
    g = torch.Generator().manual_seed(seed or 0)

    def buf() -> torch.Tensor:
        if seed is None:
            return torch.zeros(slots, cfg.heads, cfg.head_dim, dtype=torch.bfloat16,
                               device=device)
        t = torch.randn(slots, cfg.heads, cfg.head_dim, generator=g).to(torch.bfloat16)
        return t.to(device)

    pool = SimpleNamespace(page_size=cfg.page, k_buffer=[buf() for _ in range(cfg.layers)],
                           v_buffer=[buf() for _ in range(cfg.layers)])
    layers = tuple(mha_layers(pool, {i: i for i in range(cfg.layers)}))
    return PoolLayout("kv", "full", cfg.page, cfg.page, slots, layers)


def _stored(cfg: Config, store: MemoryStore) -> tuple[PoolLayout, list[str], tuple[int, ...]]:
    """Source objects in the store, offloaded by the adapter's host path."""
    src = _pool(cfg, torch.device("cpu"), cfg.seed + 1)
    keys = [f"bench/kv/{i}" for i in range(cfg.units)]
    rows = tuple(range(0, cfg.tokens, cfg.page))
    ring = StagingRing(store, cfg.staging_mib << 20)
    offloader = Offloader(store, ring, Quarantine(), 10.0)
    try:
        offloader.submit([OffloadItem(src, tuple(keys), rows)])
        if not (offloader.wait_completed(1, WAIT_S) and offloader.pop()):
            raise RuntimeError("the benchmark's objects could not be stored")
    finally:
        offloader.stop(WAIT_S)
    return src, keys, rows


def _h2d(rig: _Rig, dst: PoolLayout, rows: tuple[int, ...]) -> list[float]:
    """GB/s of each layer's H2D + scatter from pinned staging (device time)."""
    device = rig.device
    out = []
    stream = device.new_stream()
    sink = DeviceSink(device, lambda seg, part, r: scatter_units(part.target, rows, r),
                      stream=stream)
    for lp in dst.layers:
        staging = device.pinned(len(rows) * lp.nbytes).view(len(rows), lp.nbytes)
        staging.fill_(1)
        start, end = device.event(timing=True), device.event(timing=True)
        start.record(stream)
        part = SimpleNamespace(target=lp)
        seg = SimpleNamespace(lo=0, hi=len(rows), local=0)
        sink.write(seg, part, staging)  # type: ignore[arg-type]
        end.record(stream)
        end.synchronize()
        ms = max(start.elapsed_time(end), 1e-6)
        out.append(len(rows) * lp.nbytes / (ms * 1e6))
    return out


def _forward(rig: _Rig, path: DevicePath, counter: LoadCounter | None, num_layers: int,
             whole: bool) -> tuple[float, list[float]]:
    """The forward on the forward stream: per layer ``wait_until(layer)`` (or one
    ``wait_until(last)`` first), then the compute stand-in. Returns (total ms, the
    stall per layer in ms)."""
    device, fwd = rig.device, path.forward_stream
    marks: list[tuple[DeviceEvent, DeviceEvent]] = []
    begin = device.event(timing=True)
    begin.record(fwd)
    if whole and counter is not None:
        counter.wait_until(num_layers - 1)
    for layer in range(num_layers):
        before, after = device.event(timing=True), device.event(timing=True)
        before.record(fwd)
        if counter is not None:
            counter.wait_until(layer)
        after.record(fwd)
        marks.append((before, after))
        rig.compute(fwd)
    end = device.event(timing=True)
    end.record(fwd)
    end.synchronize()
    return begin.elapsed_time(end), [b.elapsed_time(a) for b, a in marks]


def _load_once(rig: _Rig, store: MemoryStore, path: DevicePath, ring: StagingRing,
               keys: list[str], rows: tuple[int, ...], src: PoolLayout, whole: bool,
               scheduler: LoadScheduler, loop: LoopThread, index: int) -> tuple[float, list[float], bool]:
    cfg = rig.cfg
    dst = _pool(cfg, rig.device.torch_device, None)
    batch = BatchLoad(index, [LoadItem("bench", dst, tuple(keys), rows)], cfg.layers, store,
                      WAIT_S, ring, depth=cfg.depth, timeout_s=WAIT_S, path=path)
    counter = LoadCounter(cfg.layers)
    counter.add(batch)
    counter.set_consumer(index)
    jobs = batch.jobs()

    async def run() -> None:
        try:
            task = scheduler.start(jobs, batch.readiness)
            await task.wait_quiescent()
        except Exception as exc:
            batch.readiness.mark_failed(0, exc)
        finally:
            batch.on_quiet()

    loop.submit(run)
    total, waits = _forward(rig, path, counter, cfg.layers, whole)
    ok = batch.finish()
    rig.device.synchronize()
    exact = ok and all(
        torch.equal(gather_units([d], rows).cpu(), gather_units([s], rows))
        for d, s in zip(dst.layers, src.layers, strict=True))
    if not batch.staged.wait_quiet(WAIT_S):
        raise RuntimeError("a load's staging did not come back")
    return total, waits, exact


def run(cfg: Config, progress: Callable[[str], None] | None = None) -> Result:
    """Run every measurement of ``cfg``; see the module docstring."""
    say = progress or (lambda _msg: None)
    rig = _Rig(cfg)
    loop = LoopThread("bench-device-adapters")
    lane = CpuLane(max_workers=cfg.depth, name="bench-sglang")
    try:
        store = MemoryStore(timeout_s=WAIT_S)
        say("storing the objects")
        src, keys, rows = _stored(cfg, store)
        path = DevicePath.open(rig.device, rig.device.new_stream())
        ring = StagingRing(store, cfg.staging_mib << 20, alloc=rig.device.pinned,
                           timeout_s=WAIT_S)
        scheduler = LoadScheduler(lane, LoadPolicy.OVERLAP, max_in_flight=cfg.depth)
        result = Result(asdict(cfg), rig.name, cfg.layer_bytes / 2**20)
        say("H2D per layer")
        h2d = [_h2d(rig, _pool(cfg, rig.device.torch_device, None), rows)
               for _ in range(cfg.repeats)]
        result.h2d_gbps = [statistics.median(v) for v in zip(*h2d, strict=True)]
        result.h2d_gbps_median = statistics.median(result.h2d_gbps)
        overlap: list[float] = []
        whole: list[float] = []
        compute: list[float] = []
        waits: list[list[float]] = []
        index = 0
        for rep in range(cfg.repeats):
            say(f"forwards, repeat {rep + 1}/{cfg.repeats}")
            for is_whole in (False, True):
                total, stalls, exact = _load_once(rig, store, path, ring, keys, rows, src,
                                                  is_whole, scheduler, loop, index)
                index += 1
                result.exact = result.exact and exact
                result.runs += 1
                (whole if is_whole else overlap).append(total)
                if not is_whole:
                    waits.append(stalls)
            compute.append(_forward(rig, path, None, cfg.layers, False)[0])
        result.overlap_ms = statistics.median(overlap)
        result.whole_ms = statistics.median(whole)
        result.compute_ms = statistics.median(compute)
        result.wait_ms = [statistics.median(v) for v in zip(*waits, strict=True)]
        return result
    finally:
        lane.close()
        loop.stop()
        rig.close()


QUICK = {"layers": 4, "tokens": 64, "page": 16, "heads": 2, "head_dim": 16,
         "staging_mib": 1, "compute_ms": 0.2, "repeats": 1}


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m layerlift.bench.device_adapters",
                                description=__doc__.split("\n\n")[0] if __doc__ else None)
    d = Config()
    p.add_argument("--device", choices=["cuda", "sim"], default=d.device)
    p.add_argument("--quick", action="store_true",
                   help=f"a few seconds: {', '.join(f'{k}={v}' for k, v in QUICK.items())} "
                        "(explicit flags still win)")
    for name in ("layers", "tokens", "page", "heads", "head_dim", "depth", "staging_mib",
                 "repeats", "seed"):
        p.add_argument(f"--{name.replace('_', '-')}", type=int, default=None)
    p.add_argument("--compute-ms", type=float, default=None)
    p.add_argument("--json", default=None, help="write the result here")
    p.add_argument("--markdown", default=None, help="write the table here")
    args = p.parse_args(argv)
    values: dict[str, Any] = dict(QUICK) if args.quick else {}
    for name in ("layers", "tokens", "page", "heads", "head_dim", "depth", "staging_mib",
                 "repeats", "seed", "compute_ms"):
        if getattr(args, name) is not None:
            values[name] = getattr(args, name)
    try:
        cfg = Config(device=args.device, **values)
    except ValueError as exc:
        p.error(str(exc))
    result = run(cfg, lambda msg: print(f"... {msg}", file=sys.stderr, flush=True))
    table = result.markdown()
    print(table)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(asdict(result), f, indent=2)
    if args.markdown:
        with open(args.markdown, "w") as f:
            f.write(table + "\n")
    return 0 if result.exact else 1


if __name__ == "__main__":
    sys.exit(main())
