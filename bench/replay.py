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

The pieces: the options (``bench/replay_args.py``), the model, link and
store view a replay runs on (``bench/replay_setting.py``), the fleet and its
router (``bench/fleet.py``, ``bench/routers.py``), and what the record says
(``bench/replay_report.py``: the summaries, the table, the plot). This
module is the driver: the runs, the pool size, the stores, the cold-run
check, and ``main``.

**Fleet** (``--instances N --router R``): N instances, each its own engine
(pool, tree, NIC) and server, on one shared store; the router picks the
instance of each arrival. Each instance's pool is ``--pool-fraction`` of the
working set.

**Simulated model** (``--model simulated``): the engine, server, tree,
pools, store and link are the real ones; the model's layers take a compute
model's time (rows say ``simulated``; ``bench/replay_setting.py``).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import sys
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from layerlift.bench import trace as tr
from layerlift.bench.fleet import run_fleet
from layerlift.bench.hostcost import HostRates, measure_rates
from layerlift.bench.replay_args import POLICIES, build_parser, check, fail
from layerlift.bench.replay_report import format_markdown, summary, write_plot
from layerlift.bench.replay_setting import Setting, build_setting, store_view
from layerlift.bench.routers import make_router
from layerlift.engine.api import Engine
from layerlift.engine.config import EngineConfig
from layerlift.engine.model.base import Model
from layerlift.engine.serve import ServeConfig, Served
from layerlift.linker.memory_store import MemoryStore
from layerlift.linker.store_base import Store
from layerlift.overlap.link import parse_link
from layerlift.pools.spec import Component, ModelSpec
from layerlift.testing.kl import KL_EXACT, kl_divergence

# build_parser, NothingToRestore and run_replay are what bench/fleet_grid.py
# runs; format_markdown and write_plot what bench/results.py draws records with.
__all__ = ["POLICIES", "NothingToRestore", "Setting", "build_parser", "build_setting",
           "format_markdown", "main", "run_replay", "write_plot"]


@dataclass(frozen=True, slots=True)
class Run:
    """One row of the replay: a policy on a link, branch checkpoints on or off."""

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
                                    else store_view(setting, link, rates))
    if split is not None and before is not None:
        after = split()
        fleet["forward_clock"] = {k: after[k] - before[k] for k in after}
    return summary(served, args.slo_ms / 1e3), served, fleet

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


def calibrate(preset: str, path: str | Path) -> None:
    """Measure and save the ``cpu-measured`` profile of ``preset`` (``bench/calibrate.py``)."""
    from layerlift.bench import calibrate as cal

    samples = asyncio.run(cal.measure(preset))
    cal.save(cal.fit_profile(preset, samples), path,
             {"preset": preset, "threads": torch.get_num_threads(), "samples": len(samples)})


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    check(args)
    torch.set_num_threads(args.threads)
    t0 = time.perf_counter()
    if args.model == "simulated" and args.arch == "reference" and \
            not Path(args.calibration).exists():
        calibrate(args.preset, args.calibration)
    try:
        out = asyncio.run(run_replay(args))
    except ValueError as exc:  # a bad trace, a placement that cannot run, nothing to restore
        fail(str(exc))
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
