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
from layerlift.engine.api import Engine
from layerlift.engine.config import EngineConfig
from layerlift.engine.model import HybridModel
from layerlift.engine.serve import ServeConfig, Served, Server
from layerlift.linker.memory_store import MemoryStore
from layerlift.linker.store_base import Store
from layerlift.overlap.link import parse_link
from layerlift.pools.spec import Component, ModelSpec
from layerlift.testing.kl import KL_EXACT, kl_divergence

__all__ = ["POLICIES", "main", "run_replay"]

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


async def _arrive(server: Server, req: tr.ScaledRequest, t0: float) -> Served:
    loop = asyncio.get_running_loop()
    await asyncio.sleep(max(0.0, t0 + req.arrival_s - loop.time()))
    return await server.submit(req.tokens)


async def _replay_one(run: Run, reqs: Sequence[tr.ScaledRequest], model: HybridModel,
                      args: argparse.Namespace, pool_bytes: int,
                      stores: _Stores) -> tuple[dict[str, Any], list[Served], bool]:
    if run.policy == "device-only":
        store: Store = MemoryStore(timeout_s=60.0)
        link, kind, offload = None, "memory", False
    else:
        store, link, kind = stores.open(run.link)
        offload = True
    policy = "barrier" if run.policy == "barrier" else "overlap"
    cfg = EngineConfig(store=kind, policy=policy, pool_bytes=pool_bytes, offload=offload,
                       link=link, namespace=f"replay-{uuid.uuid4().hex[:10]}",
                       branch_checkpoints=run.branch,
                       restore="auto" if run.policy == "overlap+auto" else "always")
    serve_cfg = ServeConfig(max_batch_tokens=args.batch_tokens,
                            prefetch=run.policy == "overlap+prefetch")
    async with Engine(model, cfg, store=store) as engine, Server(engine, serve_cfg) as server:
        t0 = asyncio.get_running_loop().time()
        served = await asyncio.gather(*(_arrive(server, r, t0) for r in reqs))
        prefetch = server.prefetch_active
    return _summary(served), served, prefetch


def _pct(xs: Sequence[float], q: float) -> float:
    return float(np.percentile(np.asarray(xs, dtype=np.float64), q)) if xs else 0.0


def _summary(served: Sequence[Served]) -> dict[str, Any]:
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
        "served_from_cache_fraction": (tokens["device_hit"] + tokens["restored"]) / total,
        "tokens": tokens,
        "prompt_tokens_per_s": total / wall if wall > 0 else 0.0,
    }


async def _cold(model: HybridModel, prompts: Sequence[np.ndarray]) -> list[torch.Tensor]:
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


def _sample(args: argparse.Namespace) -> tuple[list[tr.ScaledRequest], dict[str, Any]]:
    path = Path(args.trace) if args.trace else tr.default_trace_path(REPO)
    trace = tr.load_trace(path)
    if args.sample == "families":
        picked = tr.sample_families(trace, args.requests, args.seed)
    else:
        picked = tr.sample_window(trace, args.requests, args.start_request)
    spec = ModelSpec.preset(args.preset)
    reqs = tr.scale(picked, block_tokens=args.block_tokens, vocab_size=spec.vocab_size,
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


async def run_replay(args: argparse.Namespace) -> dict[str, Any]:
    """Run every policy of ``args`` (parsed by :func:`build_parser`)."""
    reqs, scaling = _sample(args)
    spec = ModelSpec.preset(args.preset)
    model = HybridModel(spec, seed=0)
    ws = working_set_bytes(spec, reqs)
    floor = 2 * max(request_bytes(spec, max(len(r.tokens) for r in reqs)),
                    request_bytes(spec, args.batch_tokens))
    pool = max(int(args.pool_fraction * ws), floor)
    scaling.update(working_set_bytes=ws, pool_bytes=pool, pool_fraction=args.pool_fraction,
                   effective_pool_fraction=pool / ws, batch_tokens=args.batch_tokens)
    rng = np.random.default_rng(args.seed + 1)
    kl_idx = sorted(rng.choice(len(reqs), min(args.kl_samples, len(reqs)), replace=False).tolist())
    stores = _Stores(segment_bytes=2 * ws + (64 << 20))
    policies: dict[str, dict[str, Any]] = {}
    details: dict[str, dict[str, Any]] = {}
    ttfts: dict[str, list[float]] = {}
    kept: dict[str, list[torch.Tensor]] = {}
    try:
        for run in _runs(args):
            t0 = time.perf_counter()
            summary, served, prefetch = await _replay_one(run, reqs, model, args, pool, stores)
            policies[run.name] = summary
            ttfts[run.name] = [s.ttft_s for s in served]
            kept[run.name] = [served[i].result.next_token_logprobs for i in kl_idx]
            details[run.name] = {
                "policy": run.policy, "link": "none" if run.policy == "device-only" else run.link,
                "branch_checkpoints": run.branch, "wall_s": time.perf_counter() - t0,
                "batches": len({s.batch_id for s in served}),
                "recomputed_after_failure": sum(s.result.recomputed_after_failure for s in served),
                "fallbacks": sum(s.result.fallback_reason is not None for s in served),
                "sent_to_compute": sum(s.result.fallback_reason is not None
                                       and s.result.fallback_reason.startswith("recompute")
                                       for s in served),
            }
            if run.policy == "overlap+prefetch":
                details[run.name]["prefetch_supported"] = prefetch
            if args.progress:
                print(f"  {run.name}: p90 {summary['ttft_p90_s'] * 1e3:.0f} ms, cache "
                      f"{summary['served_from_cache_fraction']:.3f} "
                      f"({details[run.name]['wall_s']:.0f} s)", file=sys.stderr)
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
        "details": details,
        "kl_samples": len(kl_idx),
        "ttft_s": ttfts,
    }


def format_markdown(out: dict[str, Any]) -> str:
    ideal = out["ideal_hit_fraction"]
    lines = [
        "| policy | TTFT p50 ms | p90 ms | p99 ms | queue p90 ms | device hit | restored | "
        "computed | from cache | / ideal | prompt tok/s | max KL |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, p in out["policies"].items():
        t = p["tokens"]
        frac = p["served_from_cache_fraction"]
        lines.append(
            f"| {name} | {p['ttft_p50_s'] * 1e3:.1f} | {p['ttft_p90_s'] * 1e3:.1f} | "
            f"{p['ttft_p99_s'] * 1e3:.1f} | {p['queue_p90_s'] * 1e3:.1f} | {t['device_hit']} | "
            f"{t['restored']} | {t['computed']} | {frac:.3f} | {frac / ideal:.2f} | "
            f"{p['prompt_tokens_per_s']:.0f} | {out['details'][name]['max_kl']:.1e} |")
    s = out["scaling"]
    lines.append("")
    lines.append(
        f"{s['requests']} requests ({s['sample']}, seed {s['seed']}), blocks of "
        f"{s['block_tokens']} tokens (trace: {s['trace_block_tokens']}), clock x{s['time_scale']:g}"
        f" ({s['trace_span_s']:.0f} s of trace in {s['replay_span_s']:.1f} s), preset "
        f"{s['preset']}, pool {s['pool_bytes'] / 2**20:.1f} MiB = "
        f"{s['effective_pool_fraction']:.2f} of the working set; ideal hit fraction "
        f"{ideal:.3f}; KL over {out['kl_samples']} sampled requests per policy.")
    for name, d in out["details"].items():
        if "prefetch_supported" in d and not d["prefetch_supported"]:
            lines.append(f"`{name}`: the engine has no cross-batch prefetch yet; "
                         "this row ran as plain overlap (prefetch_supported: false).")
    return "\n".join(lines) + "\n"


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
                    "cache policy: TTFT, queueing, tokens by source against the ideal.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--trace", default=None,
                    help="trace jsonl (default: ../shared/traces/conversation_trace.jsonl "
                         "next to the repository)")
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
    ap.add_argument("--json", default=None, help="write the results as JSON here")
    ap.add_argument("--markdown", default=None, help="write a Markdown table here")
    ap.add_argument("--plot", default=None, help="write the TTFT CDF (PNG) here")
    ap.add_argument("--quiet", dest="progress", action="store_false",
                    help="no per-policy line on stderr")
    return ap


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.requests < 1 or args.block_tokens < 1 or args.time_scale <= 0:
        raise SystemExit("error: --requests and --block-tokens must be >= 1, --time-scale > 0")
    if args.pool_fraction <= 0:
        raise SystemExit("error: --pool-fraction must be positive")
    torch.set_num_threads(args.threads)
    t0 = time.perf_counter()
    out = asyncio.run(run_replay(args))
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
