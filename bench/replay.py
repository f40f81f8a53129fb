"""`layerlift bench replay`: the conversation trace, replayed open-loop
through the serving loop, per cache policy.

Every policy serves the same sampled, scaled requests (``bench/trace.py``)
on a fresh engine and an empty store, arrivals on the scaled clock:

* ``device-only``: no store (nothing offloaded): the device tree alone;
* ``barrier`` / ``overlap``: device tree + store; restores wait for every
  layer / per layer;
* ``overlap+prefetch``: overlap with ``ServeConfig(prefetch=True)``: two
  batches in flight, the next one's LOOKUP and LOAD running while the
  current one computes (``prefetch_supported`` in the details says whether
  the server ran it so);
* ``overlap+auto``: overlap with ``EngineConfig(restore="auto")``: per
  request, restore only when the engine's learned cost model says it beats
  computing (the details count the requests it sent to compute).

The device pool is ``--pool-fraction`` of the replay's working set (its
distinct tokens' FULL+SWA pages plus one checkpoint per interval), so
eviction, and the store, decide what is served from cache. A sample of
requests is checked against cold runs (a fresh engine with no cache).

**Fleet** (``--instances N --router R``, ``bench/fleet.py``): N instances,
each its own engine (pool, tree, NIC) and server, on one shared store; the
router (``bench/routers.py``) picks the instance of each arrival. Each
instance's pool is ``--pool-fraction`` of the working set.

**Simulated model** (``--model simulated``): the engine, server, tree,
pools, store and link are the real ones; the model is
:class:`~layerlift.engine.model.simulated.SimulatedModel`, whose layers
take a compute model's time (rows say ``simulated``). ``--arch reference``
is the reference model's own layout with the ``cpu-measured`` profile
(``--calibration``, fitted by ``bench/calibrate.py`` when missing): the
fidelity check against real mode. ``--arch NAME`` is a published
architecture at token scale ``512 / --block-tokens`` (one trace block, one
page) on ``--device`` (``--gpus`` per instance) with ``--network``'s NIC
per GPU, scaled as ``engine/model/architectures.py`` describes.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import sys
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NoReturn

import numpy as np
import torch

from layerlift.bench import trace as tr
from layerlift.bench.fleet import NETWORKS, run_fleet
from layerlift.bench.hostcost import HostCostStore, HostRates, measure_rates
from layerlift.bench.routers import ROUTERS, make_router
from layerlift.engine.api import Engine
from layerlift.engine.config import EngineConfig
from layerlift.engine.costmodel import CostPriors
from layerlift.engine.model import HybridModel
from layerlift.engine.model.architectures import ARCHITECTURES, simulated_spec
from layerlift.engine.model.base import Model
from layerlift.engine.model.compute_model import DEVICES, ComputeModel, RooflineCompute, SeqWork
from layerlift.engine.model.simulated import SimulatedModel
from layerlift.engine.serve import ServeConfig, Served
from layerlift.linker.memory_store import MemoryStore
from layerlift.linker.store_base import Store
from layerlift.overlap.link import EmulatedLink, parse_link
from layerlift.pools.spec import Component, ModelSpec
from layerlift.testing.kl import KL_EXACT, kl_divergence

__all__ = ["POLICIES", "Setting", "build_setting", "main", "run_replay"]

POLICIES = ("device-only", "barrier", "overlap", "overlap+prefetch", "overlap+auto")
DEFAULT_LINK = "emulated:0.1,10"
REPO = Path(__file__).resolve().parents[1]


@dataclass(frozen=True, slots=True)
class Run:
    policy: str
    link: str
    branch: bool
    name: str


def _runs(args: argparse.Namespace) -> list[Run]:
    branches = {"on": [True], "off": [False], "both": [True, False]}[args.branch_checkpoints]
    out = []
    for link in args.links:
        for br in branches:
            for pol in args.policies:
                name = pol
                if len(branches) > 1 and not br:
                    name += " (branch off)"
                if len(args.links) > 1:
                    name += f" @{link}"
                out.append(Run(pol, link, br, name))
    return out


def working_set_bytes(spec: ModelSpec, reqs: Sequence[tr.ScaledRequest]) -> int:
    """Bytes of every distinct token's FULL+SWA pages and one checkpoint per
    track interval: what an unbounded device cache would hold."""
    longest: dict[int, int] = {}
    for r in reqs:
        for h, size in zip(r.block_ids, r.block_sizes, strict=True):
            longest[h] = max(longest.get(h, 0), size)
    tokens = sum(longest.values())
    per_page = spec.page_bytes(Component.FULL) + spec.page_bytes(Component.SWA)
    return (math.ceil(tokens / spec.page_size) * per_page
            + math.ceil(tokens / spec.track_interval) * spec.page_bytes(Component.MAMBA))


def request_bytes(spec: ModelSpec, tokens: int) -> int:
    per_page = spec.page_bytes(Component.FULL) + spec.page_bytes(Component.SWA)
    return ((math.ceil(tokens / spec.page_size) + 1) * per_page
            + (tokens // spec.track_interval + 3) * spec.page_bytes(Component.MAMBA))


class _Stores:
    """A fresh store per run: in-process (emulated link) or a namespace on
    one embedded Mooncake master shared by the runs."""

    def __init__(self, segment_bytes: int) -> None:
        self.segment_bytes = segment_bytes
        self.master: Any = None
        self._clients: list[Any] = []

    def open(self, link: str) -> tuple[Store, str | None, str]:
        if parse_link(link) is not None:
            return MemoryStore(timeout_s=60.0), link, "memory"
        if self.master is None:
            from layerlift.linker.master import EmbeddedMaster
            from layerlift.linker.mooncake_store import MooncakeStore

            self.master = EmbeddedMaster(lease_ttl_ms=5000).start()
            self._clients.append(MooncakeStore(self.master.config(
                global_segment_size=self.segment_bytes, timeout_s=60.0)))
            self._clients.insert(0, MooncakeStore(self.master.config(
                global_segment_size=0, local_buffer_size=16 << 20, timeout_s=60.0)))
        return self._clients[0], None, "embedded"

    def close(self) -> None:
        for c in self._clients:
            c.close()
        self._clients.clear()
        if self.master is not None:
            self.master.stop()
            self.master = None


@dataclass(frozen=True, slots=True)
class Setting:
    """The model a replay runs and what it says about it: ``mode`` real or
    simulated, the compute profile, the token scale, the link the
    store-backed policies use, and the priors the restore-aware router
    prices with."""

    model: Model
    mode: str
    profile: str
    token_scale: int
    links: list[str]
    priors: CostPriors
    info: dict[str, Any]


def _priors(compute: ComputeModel | None, model: Model, link: str | None,
            typical_tokens: int) -> CostPriors:
    """Cost-model priors of a setting: the link's rate and latency, and the
    compute model's seconds per token for one prompt of ``typical_tokens``."""
    parsed = parse_link(link) if link else None
    bw = parsed.gbps * 1e9 if parsed else 1e9
    lat = parsed.latency_us * 1e-6 if parsed else 50e-6
    if compute is None:
        return CostPriors(bw, lat)
    k = getattr(model, "token_scale", 1)
    n = max(1, typical_tokens)
    per_tok = sum(compute.layer_seconds(model.spec.kinds, [SeqWork(0, n * k)])) / n
    return CostPriors(bw, lat, per_tok)


def build_setting(args: argparse.Namespace) -> Setting:
    """Real (the reference model of ``--preset``) or simulated (``--arch``)."""
    if args.model == "real":
        model: Model = HybridModel(ModelSpec.preset(args.preset), seed=0)
        info: dict[str, Any] = {"arch": f"reference:{args.preset}",
                                "profile": "real (this CPU)"}
        return Setting(model, "real", "real", 1, list(args.links),
                       _priors(None, model, args.links[0], 0), info)
    if args.arch == "reference":
        from layerlift.bench import calibrate

        path = Path(args.calibration)
        compute: ComputeModel = calibrate.load(path)
        spec = ModelSpec.preset(args.preset)
        model = SimulatedModel(spec, compute, token_scale=1, vocab_size=spec.dims.vocab_size,
                               name=f"reference-{args.preset}")
        info = {"arch": f"reference:{args.preset}", "profile": compute.name,
                "calibration": str(path)}
        return Setting(model, "simulated", compute.name, 1, list(args.links),
                       _priors(compute, model, args.links[0], 256), info)
    arch = ARCHITECTURES[args.arch]
    if tr.TRACE_BLOCK_TOKENS % args.block_tokens:
        raise ValueError(f"--block-tokens must divide {tr.TRACE_BLOCK_TOKENS} "
                         "for a simulated architecture")
    k = tr.TRACE_BLOCK_TOKENS // args.block_tokens
    page = args.block_tokens
    if arch.window:  # the sliding window in pages of simulated tokens
        page = math.gcd(page, max(1, arch.window // k))
    spec = simulated_spec(arch.name, token_scale=k, page_size=page,
                          track_interval=args.track_blocks * args.block_tokens)
    gpus = args.gpus or arch.default_gpus
    if args.device not in DEVICES:
        raise ValueError(f"--device {args.device} is not a GPU profile "
                         f"({', '.join(DEVICES)}); cpu-measured needs --arch reference")
    device = DEVICES[args.device].with_gpus(gpus)
    compute = RooflineCompute(arch, device)
    model = SimulatedModel(spec, compute, token_scale=k, vocab_size=32000, name=arch.name)
    net = NETWORKS[args.network]
    link = net.link(nics=gpus, token_scale=k)
    info = {"arch": arch.name, "arch_source": arch.source, "profile": compute.name,
            "device_source": device.source, "util": device.util, "mem_util": device.mem_util,
            "gpus": gpus, "network": net.name, "network_gbps_per_nic": net.gbps,
            "network_source": net.source, "page_tokens": page, "swa_window": spec.swa_window,
            "track_interval": spec.track_interval}
    return Setting(model, "simulated", compute.name, k, [link],
                   _priors(compute, model, link, 14000 // k), info)


def _view(setting: Setting, link: str | None,
          rates: HostRates | None) -> Callable[[Store], Store] | None:
    """Each instance's view of the shared store: the host work of the
    bytes the token scale leaves out, and puts on the NIC's egress
    (``bench/hostcost.py``); None when host costs are not charged."""
    if rates is None:
        return None
    parsed = parse_link(link) if link else None

    def view(store: Store) -> Store:
        egress = EmulatedLink(parsed.gbps, parsed.latency_us) if parsed else None
        return HostCostStore(store, token_scale=setting.token_scale, rates=rates,
                             ingress_gbps=parsed.gbps if parsed else None, egress=egress)
    return view


async def _replay_one(run: Run, reqs: Sequence[tr.ScaledRequest], setting: Setting,
                      args: argparse.Namespace, pool_bytes: int, stores: _Stores,
                      rates: HostRates | None
                      ) -> tuple[dict[str, Any], list[Served], dict[str, Any]]:
    if run.policy == "device-only":
        store: Store = MemoryStore(timeout_s=60.0)
        link, kind, offload = None, "memory", False
    else:
        store, link, kind = stores.open(run.link)
        offload = True
    policy = "barrier" if run.policy == "barrier" else "overlap"
    namespace = f"replay-{uuid.uuid4().hex[:10]}"
    cfg = EngineConfig(store=kind, policy=policy, pool_bytes=pool_bytes, offload=offload,
                       link=link, namespace=namespace, branch_checkpoints=run.branch,
                       restore="auto" if run.policy == "overlap+auto" else "always")
    serve_cfg = ServeConfig(max_batch_tokens=args.batch_tokens,
                            prefetch=run.policy == "overlap+prefetch")
    router = make_router(args.router, setting.priors)
    split = getattr(setting.model, "clock_split", None)
    before = split() if split is not None else None
    served, fleet = await run_fleet(setting.model, [cfg] * args.instances, store, serve_cfg,
                                    router, reqs, None if run.policy == "device-only"
                                    else _view(setting, link, rates))
    if split is not None and before is not None:
        after = split()
        fleet["forward_clock"] = {k: after[k] - before[k] for k in after}
    return _summary(served, args.slo_ms / 1e3), served, fleet


def _pct(xs: Sequence[float], q: float) -> float:
    return float(np.percentile(np.asarray(xs, dtype=np.float64), q)) if xs else 0.0


def _summary(served: Sequence[Served], slo_s: float) -> dict[str, Any]:
    ttft = [s.ttft_s for s in served]
    tokens = {
        "device_hit": sum(s.result.device_hit_tokens for s in served),
        "restored": sum(s.result.restored_tokens for s in served),
        "computed": sum(s.result.computed_tokens for s in served),
    }
    total = sum(tokens.values())
    wall = max(s.finished for s in served) - min(s.submitted for s in served)
    return {
        "ttft_p50_s": _pct(ttft, 50), "ttft_p90_s": _pct(ttft, 90), "ttft_p99_s": _pct(ttft, 99),
        "queue_p90_s": _pct([s.queue_s for s in served], 90),
        "within_slo_fraction": sum(t <= slo_s for t in ttft) / len(ttft),
        "served_from_cache_fraction": (tokens["device_hit"] + tokens["restored"]) / total,
        "tokens": tokens,
        # the arrival rate the trace offers (requests arrive open-loop): the
        # same for every policy that keeps up, not a measured capacity
        "offered_tokens_per_s": total / wall if wall > 0 else 0.0,
        "prompt_tokens_per_s": total / wall if wall > 0 else 0.0,  # old name, same value
        "served_s": wall,
    }


async def _cold(model: Model, prompts: Sequence[np.ndarray]) -> list[torch.Tensor]:
    """Next-token log-probs of each prompt on a fresh engine with no cache."""
    spec = model.spec
    need = max(request_bytes(spec, len(p)) for p in prompts)
    out = []
    async with Engine(model, EngineConfig(store="memory", offload=False,
                                          pool_bytes=2 * need + (8 << 20))) as eng:
        for p in prompts:
            eng.drop_device_cache()
            (res,) = await eng.prefill([p])
            assert res.device_hit_tokens == 0 and res.restored_tokens == 0
            out.append(res.next_token_logprobs)
    return out


def _sample(args: argparse.Namespace, vocab_size: int
            ) -> tuple[list[tr.ScaledRequest], dict[str, Any]]:
    path = Path(args.trace) if args.trace else tr.default_trace_path()
    trace = tr.load_trace(path)
    if args.sample == "families":
        picked = tr.sample_families(trace, args.requests, args.seed)
    else:
        picked = tr.sample_window(trace, args.requests, args.start_request)
    reqs = tr.scale(picked, block_tokens=args.block_tokens, vocab_size=vocab_size,
                    time_scale=args.time_scale, seed=args.seed)
    span = max(r.timestamp_ms for r in picked) - min(r.timestamp_ms for r in picked)
    scaling = {
        "trace": str(path), "sample": args.sample, "requests": len(reqs), "seed": args.seed,
        "start_request": args.start_request if args.sample == "window" else None,
        "block_tokens": args.block_tokens, "trace_block_tokens": tr.TRACE_BLOCK_TOKENS,
        "token_scale": args.block_tokens / tr.TRACE_BLOCK_TOKENS,
        "time_scale": args.time_scale, "trace_span_s": span / 1e3,
        "replay_span_s": max((r.arrival_s for r in reqs), default=0.0),
        "mean_prompt_tokens": float(np.mean([len(r.tokens) for r in reqs])),
        "mean_trace_prompt_tokens": float(np.mean([r.input_length for r in picked])),
        "trace_block_hit_fraction": tr.block_hit_fraction(picked),
        "preset": args.preset,
    }
    return reqs, scaling


def _details(run: Run, served: Sequence[Served], fleet: dict[str, Any],
             wall_s: float) -> dict[str, Any]:
    out = {
        "policy": run.policy, "link": "none" if run.policy == "device-only" else run.link,
        "branch_checkpoints": run.branch, "wall_s": wall_s,
        "batches": len({(i, s.batch_id) for s, i in zip(served, fleet["instance_of"],
                                                        strict=True)}),
        "recomputed_after_failure": sum(s.result.recomputed_after_failure for s in served),
        "fallbacks": sum(s.result.fallback_reason is not None for s in served),
        "sent_to_compute": sum(s.result.fallback_reason is not None
                               and s.result.fallback_reason.startswith("recompute")
                               for s in served),
        "requests_per_instance": fleet["requests_per_instance"],
        "loop_lag": fleet["loop_lag"],
        "host_cost": fleet["host_cost"],
        "forward_clock": fleet.get("forward_clock"),
    }
    if run.policy == "overlap+prefetch":
        out["prefetch_supported"] = fleet["prefetch_active"]
    return out


class NothingToRestore(ValueError):
    """The replay cannot compare the policies: nothing would be evicted."""


def pool_note(pool: int, ws: int, fraction: float, instances: int) -> str | None:
    """What a raised pool means for the comparison (None when it was not
    raised). Raises :class:`NothingToRestore` when one instance's pool holds
    the whole working set: nothing is evicted, so no policy restores
    anything and every policy serves the same device hits."""
    asked = int(fraction * ws)
    if pool <= asked:
        return None
    mib = 2**20
    if pool >= ws and instances == 1:
        raise NothingToRestore(
            f"the pool must hold two of the longest requests ({pool / mib:.1f} MiB), which is "
            f"more than the replay's whole working set ({ws / mib:.1f} MiB): nothing would be "
            "evicted, so no policy would restore anything; sample more requests (--requests) "
            "or run a fleet (--instances)")
    return (f"the pool was raised from {fraction:.2f} of the working set ({asked / mib:.1f} "
            f"MiB) to {pool / ws:.2f} of it ({pool / mib:.1f} MiB) to hold two of the longest "
            "requests: less is evicted than asked, so fewer tokens are restored and the "
            "store-backed policies differ less from device-only than at the asked fraction")


async def run_replay(args: argparse.Namespace) -> dict[str, Any]:
    """Run every policy of ``args`` (parsed by :func:`build_parser`).
    Raises :class:`NothingToRestore` (see :func:`pool_note`), ``ValueError``
    for a setting that cannot run (weights that do not fit), and what
    :func:`~layerlift.bench.trace.load_trace` raises."""
    setting = build_setting(args)
    model, spec = setting.model, setting.model.spec
    args.links = setting.links
    reqs, scaling = _sample(args, model.vocab_size)
    ws = working_set_bytes(spec, reqs)
    floor = 2 * max(request_bytes(spec, max(len(r.tokens) for r in reqs)),
                    request_bytes(spec, args.batch_tokens))
    pool = max(int(args.pool_fraction * ws), floor)
    note = pool_note(pool, ws, args.pool_fraction, args.instances)
    scaling.update(working_set_bytes=ws, pool_bytes=pool, pool_fraction=args.pool_fraction,
                   effective_pool_fraction=pool / ws, batch_tokens=args.batch_tokens,
                   pool_raised=pool > int(args.pool_fraction * ws), pool_note=note)
    if note and args.progress:
        print(f"note: {note}", file=sys.stderr, flush=True)
    rates = measure_rates() if args.host_costs == "charged" else None
    scaling["host_rates"] = None if rates is None else {
        "crc_s_per_byte": rates.crc_s_per_byte, "copy_s_per_byte": rates.copy_s_per_byte}
    rng = np.random.default_rng(args.seed + 1)
    kl_idx = sorted(rng.choice(len(reqs), min(args.kl_samples, len(reqs)), replace=False).tolist())
    stores = _Stores(segment_bytes=2 * ws + (64 << 20))
    policies: dict[str, dict[str, Any]] = {}
    details: dict[str, dict[str, Any]] = {}
    ttfts: dict[str, list[float]] = {}
    kept: dict[str, list[torch.Tensor]] = {}
    runs = _runs(args)
    try:
        for i, run in enumerate(runs):
            if args.progress:
                print(f"[{i + 1}/{len(runs)}] {run.name}: {len(reqs)} requests on "
                      f"{args.instances} instance(s), about {scaling['replay_span_s']:.0f} s "
                      "of arrivals ...", file=sys.stderr, flush=True)
            t0 = time.perf_counter()
            summary, served, fleet = await _replay_one(run, reqs, setting, args, pool, stores,
                                                       rates)
            policies[run.name] = summary
            ttfts[run.name] = [s.ttft_s for s in served]
            kept[run.name] = [served[i].result.next_token_logprobs for i in kl_idx]
            details[run.name] = _details(run, served, fleet, time.perf_counter() - t0)
            if args.progress:
                print(f"  {run.name}: p90 {summary['ttft_p90_s'] * 1e3:.0f} ms, cache "
                      f"{summary['served_from_cache_fraction']:.3f} "
                      f"({details[run.name]['wall_s']:.0f} s)", file=sys.stderr, flush=True)
    finally:
        stores.close()
    cold = await _cold(model, [reqs[i].tokens for i in kl_idx])
    for name, got in kept.items():
        kls = [kl_divergence(c, g) for c, g in zip(cold, got, strict=True)]
        details[name]["max_kl"] = max(kls, default=0.0)
    return {
        "policies": policies,
        "ideal_hit_fraction": tr.ideal_hit_fraction(reqs),
        "max_kl": max((d["max_kl"] for d in details.values()), default=0.0),
        "scaling": scaling,
        "fleet": {"instances": args.instances, "router": args.router, "slo_ms": args.slo_ms},
        "setting": {"mode": setting.mode, "profile": setting.profile,
                    "token_scale": setting.token_scale, "links": setting.links,
                    "simulated": setting.mode == "simulated", **setting.info},
        "details": details,
        "kl_samples": len(kl_idx),
        "ttft_s": ttfts,
    }


def format_markdown(out: dict[str, Any]) -> str:
    ideal = out["ideal_hit_fraction"]
    lines = [
        "| policy | TTFT p50 ms | p90 ms | p99 ms | queue p90 ms | within SLO | device hit | "
        "restored | computed | from cache | / ideal | offered tok/s | max KL |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, p in out["policies"].items():
        t = p["tokens"]
        frac = p["served_from_cache_fraction"]
        lines.append(
            f"| {name} | {p['ttft_p50_s'] * 1e3:.1f} | {p['ttft_p90_s'] * 1e3:.1f} | "
            f"{p['ttft_p99_s'] * 1e3:.1f} | {p['queue_p90_s'] * 1e3:.1f} | "
            f"{_f(p.get('within_slo_fraction'))} | {t['device_hit']} | "
            f"{t['restored']} | {t['computed']} | {frac:.3f} | {frac / ideal:.2f} | "
            f"{p.get('offered_tokens_per_s', p['prompt_tokens_per_s']):.0f} | "
            f"{out['details'][name]['max_kl']:.1e} |")
    s = out["scaling"]
    lines.append("")
    lines.append(
        f"{s['requests']} requests ({s['sample']}, seed {s['seed']}), blocks of "
        f"{s['block_tokens']} tokens (trace: {s['trace_block_tokens']}), clock x{s['time_scale']:g}"
        f" ({s['trace_span_s']:.0f} s of trace in {s['replay_span_s']:.1f} s), preset "
        f"{s['preset']}, pool {s['pool_bytes'] / 2**20:.1f} MiB = "
        f"{s['effective_pool_fraction']:.2f} of the working set; ideal hit fraction "
        f"{ideal:.3f}; KL over {out['kl_samples']} sampled requests per policy. Offered tok/s: "
        "the prompt tokens the trace offers per second of the replay (open-loop arrivals), "
        "not a measured capacity.")
    if s.get("pool_note"):
        lines.append(f"Note: {s['pool_note']}.")
    st, fl = out.get("setting"), out.get("fleet")
    if st is not None and fl is not None:
        sim = " (simulated)" if st["simulated"] else ""
        lines.append(
            f"Setting: {st['mode']}{sim}, {st['arch']}, profile {st['profile']}, token scale "
            f"{st['token_scale']}, link {', '.join(st['links'])}; {fl['instances']} instance(s), "
            f"router {fl['router']}; SLO: TTFT <= {fl['slo_ms']:g} ms.")
    for name, d in out["details"].items():
        hc, fc = d.get("host_cost") or {}, d.get("forward_clock")
        if hc:
            lines.append(
                f"`{name}`: host work charged for the bytes the token scale leaves out: "
                f"{hc['read_host_s']:.2f} s on {hc['read_bytes'] / 2**20:.1f} MiB read, "
                f"{hc['put_host_s']:.2f} s on {hc['put_bytes'] / 2**20:.1f} MiB put.")
        if fc:
            lines.append(
                f"`{name}`: forwards' wall time: {fc['modeled_s']:.2f} s modeled GPU, "
                f"{fc['waited_s']:.2f} s blocked on restores, {fc['host_s']:.2f} s host "
                f"({fc['forwards']:.0f} forwards).")
        if "prefetch_supported" in d and not d["prefetch_supported"]:
            lines.append(f"`{name}`: the engine has no cross-batch prefetch yet; "
                         "this row ran as plain overlap (prefetch_supported: false).")
    return "\n".join(lines) + "\n"


def _f(x: float | None) -> str:
    return "-" if x is None else f"{x:.3f}"


def write_plot(out: dict[str, Any], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for name, xs in out["ttft_s"].items():
        ys = np.sort(np.asarray(xs)) * 1e3
        ax.plot(ys, np.arange(1, len(ys) + 1) / len(ys), label=name)
    ax.set_xscale("log")
    ax.set_xlabel("TTFT (ms, log)")
    ax.set_ylabel("fraction of requests")
    ax.set_title("TTFT CDF, conversation trace replay")
    ax.grid(True, alpha=0.3)
    ax.legend()
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _csv(text: str) -> list[str]:
    return [x for x in text.replace(" ", "").split(",") if x]


def _policies(text: str) -> list[str]:
    out = _csv(text)
    bad = [p for p in out if p not in POLICIES]
    if bad or not out:
        raise argparse.ArgumentTypeError(f"unknown policies {bad}; choose from {list(POLICIES)}")
    return out


def _links(text: str) -> list[str]:
    from layerlift.bench.ttft import _links as parse

    try:
        return parse(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="layerlift bench replay",
        description="Replay the Mooncake conversation trace through the serving loop, per "
                    "cache policy, on one instance or a routed fleet, with the reference "
                    "model or the simulated one: TTFT, queueing, tokens by source.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--trace", default=None,
                    help="trace jsonl or jsonl.gz (default: the bundled Mooncake conversation "
                         "trace, bench/data/conversation_trace.jsonl.gz)")
    ap.add_argument("--requests", type=int, default=200, help="about this many requests")
    ap.add_argument("--sample", choices=["families", "window"], default="families")
    ap.add_argument("--start-request", type=int, default=0, help="first request (window)")
    ap.add_argument("--seed", type=int, default=0, help="sampling, token and KL-sample seed")
    ap.add_argument("--block-tokens", type=int, default=48,
                    help="tokens per trace block (the trace's are 512)")
    ap.add_argument("--time-scale", type=float, default=100.0,
                    help="replay the arrivals this many times faster")
    ap.add_argument("--pool-fraction", type=float, default=0.25,
                    help="device pool as a fraction of the replay's working set")
    ap.add_argument("--policies", type=_policies, default=list(POLICIES),
                    help=f"comma separated, from {','.join(POLICIES)}")
    ap.add_argument("--links", type=_links, default=[DEFAULT_LINK],
                    help="mooncake (embedded master on loopback) and/or emulated:GBPS[,LAT_US]")
    ap.add_argument("--branch-checkpoints", choices=["on", "off", "both"], default="on")
    ap.add_argument("--preset", default="tiny", choices=ModelSpec.preset_names())
    ap.add_argument("--batch-tokens", type=int, default=4096,
                    help="the server's max_batch_tokens")
    ap.add_argument("--kl-samples", type=int, default=8, help="requests checked against cold runs")
    ap.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    ap.add_argument("--instances", type=int, default=1,
                    help="serving instances on one shared store (a fleet)")
    ap.add_argument("--router", choices=ROUTERS, default="round-robin",
                    help="which instance serves each arrival")
    ap.add_argument("--slo-ms", type=float, default=1000.0,
                    help="TTFT SLO: the fraction of requests within it is reported")
    ap.add_argument("--model", choices=["real", "simulated"], default="real",
                    help="the reference model on this CPU, or the simulated model")
    ap.add_argument("--arch", choices=["reference", *ARCHITECTURES], default="reference",
                    help="simulated: the reference layout (cpu-measured) or a published one")
    ap.add_argument("--device", default="h100", help=f"simulated GPU: {', '.join(DEVICES)}")
    ap.add_argument("--gpus", type=int, default=0,
                    help="GPUs (and NICs) per instance; 0: the architecture's default")
    ap.add_argument("--network", choices=list(NETWORKS), default="rdma",
                    help="simulated: each GPU's NIC to the store")
    ap.add_argument("--track-blocks", type=int, default=4,
                    help="simulated architecture: trace blocks per checkpoint interval")
    ap.add_argument("--calibration", default=str(REPO / "bench" / "results" / "fleet" /
                                                   "cpu_profile.json"),
                    help="the cpu-measured profile (measured here when missing)")
    ap.add_argument("--json", default=None, help="write the results as JSON here")
    ap.add_argument("--markdown", default=None, help="write a Markdown table here")
    ap.add_argument("--plot", default=None, help="write the TTFT CDF (PNG) here")
    ap.add_argument("--host-costs", choices=["charged", "off"], default="charged",
                    help="charged: the CRC check and copies of the bytes the token scale leaves "
                         "out are charged at this machine's rates, and offload puts go through "
                         "an emulated egress NIC (bench/hostcost.py); off: neither")
    ap.add_argument("--quiet", dest="progress", action="store_false",
                    help="no progress lines on stderr")
    return ap


def calibrate(preset: str, path: str | Path) -> None:
    """Measure and save the ``cpu-measured`` profile of ``preset`` (``bench/calibrate.py``)."""
    from layerlift.bench import calibrate as cal

    samples = asyncio.run(cal.measure(preset))
    cal.save(cal.fit_profile(preset, samples), path,
             {"preset": preset, "threads": torch.get_num_threads(), "samples": len(samples)})


def _fail(message: str) -> NoReturn:
    """One line on stderr and exit status 2 (bad input or a run that cannot compare)."""
    print(f"layerlift bench replay: error: {message}", file=sys.stderr)
    raise SystemExit(2)


def _check(args: argparse.Namespace) -> None:
    if args.requests < 1 or args.block_tokens < 1 or args.time_scale <= 0:
        _fail("--requests and --block-tokens must be >= 1, --time-scale > 0")
    if args.pool_fraction <= 0:
        _fail("--pool-fraction must be positive")
    if args.instances < 1 or args.gpus < 0 or args.track_blocks < 1 or args.slo_ms <= 0:
        _fail("--instances and --track-blocks must be >= 1, --gpus >= 0, --slo-ms > 0")
    if args.trace is not None and not Path(args.trace).is_file():
        _fail(f"--trace {args.trace}: no such file; give a trace .jsonl (or .jsonl.gz), or "
              "leave --trace out for the bundled one (bench/data/conversation_trace.jsonl.gz)")


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    _check(args)
    torch.set_num_threads(args.threads)
    t0 = time.perf_counter()
    if args.model == "simulated" and args.arch == "reference" and \
            not Path(args.calibration).exists():
        calibrate(args.preset, args.calibration)
    try:
        out = asyncio.run(run_replay(args))
    except ValueError as exc:  # a bad trace, a placement that cannot run, nothing to restore
        _fail(str(exc))
    cmd = "layerlift bench replay " + " ".join(sys.argv[1:] if argv is None else argv)
    out["meta"] = {"command": cmd.strip(), "wall_s": time.perf_counter() - t0,
                   "torch_threads": torch.get_num_threads(), "kl_tol": KL_EXACT}
    text = format_markdown(out)
    print(text, end="")
    print(f"wall time {out['meta']['wall_s']:.1f} s")
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(out, indent=1))
    if args.markdown:
        Path(args.markdown).parent.mkdir(parents=True, exist_ok=True)
        Path(args.markdown).write_text(text)
    if args.plot:
        write_plot(out, args.plot)
    if out["max_kl"] > KL_EXACT:
        print(f"FLAG: max KL {out['max_kl']:.2e} > {KL_EXACT:g}: a restored result differs "
              "from its cold run")
        return 1
    return 0
