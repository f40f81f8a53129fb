"""`layerlift bench ttft`: time to first token of recompute, barrier restore and
overlap restore on the same prompts (docs/design.md §5).

Per link mode and model preset the harness opens ONE store shared by four engines:

* ``writer``    (policy overlap, offload on,  namespace A): computes each point's prefixes
  once (round 0) and offloads them; ``wait_offloads()`` before measuring.
* ``recompute`` (offload off, namespace B): nothing in the store matches, so the whole
  prompt is computed (its lookup is a miss: a cheap ``exists`` call).
* ``barrier``   (policy barrier, offload off, namespace A): the forward starts when every
  layer has landed.
* ``overlap``   (policy overlap, offload off, namespace A): layer l waits for layer l only.

The measuring engines never offload, so the store holds exactly the prefixes and every
restore is of ``prefix_tokens`` tokens. Each repeat runs the three strategies back to back,
in an order rotated per repeat (no strategy always runs first), each after
``drop_device_cache()``; TTFT is ``result.timings.ttft`` (from the
``prefill`` call to the next-token distribution). After a point its keys are removed.

Link modes: ``mooncake`` — one ``mooncake_master`` started here, one client that holds the
segment (``global_segment_size``) and one pure client (segment 0) that the engines share,
so every restore is a real Mooncake TCP transfer over loopback; ``emulated:GBPS[,LAT_US]``
— a shared in-process ``MemoryStore`` whose fetches copy the real bytes into the pools and
then sleep until a modeled NIC would have delivered them (costs no CPU).

The barrier reads every page object whole in one batch call (the best whole-batch
restore), streamed through one worker call like the overlap's per-layer reads.
Per-layer profile: ``A_l`` = when layer l landed in the overlap run minus when its loads
were issued (running max; those loads never wait for the forward), ``a_l`` =
``A_l - A_{l-1}``, ``c_l`` = the barrier forward's ``layer_compute`` (nothing overlaps it
there). ``load_s = Σa``, ``compute_s = Σc``, ``barrier_load_s`` = the barrier's one
whole-object read. The fixed overhead ``T_barrier - barrier_load_s - Σc`` (lookup, PREPARE, issuing,
thread hand-offs, logits) is charged to the bound unchanged, so
``bound = overhead + max(Σa + c_last, a_0 + Σc)`` and
``T_barrier - bound = min(Σa - a_0, Σc - c_last)`` is the most overlap can save.
``efficiency = (T_barrier - T_overlap) / (T_barrier - bound)`` (None when that is < 1 ms).
The bound is not always reachable: when a layer with a heavy load also computes heavily
and only light layers follow, even a perfect overlap pays that compute after the last
big load. ``model_overlap_s`` runs the recurrence ``F_l = max(A_l, F_{l-1}) + c_l`` on the
measured profile (plus the same overhead) and ``efficiency_model`` measures the overlap
against it: the share of the achievable gain actually had.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
import uuid
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from layerlift.bench import machine_cpu
from layerlift.bench.models import build_model
from layerlift.bench.netns_link import emulated_twin, is_netns, run_netns_link
from layerlift.bench.report import (
    HEADER,
    STRATEGIES,
    format_markdown,
    format_table,
    table_notes,
    write_plot,
)
from layerlift.bench.stats import KL_TOL, Samples, summarize
from layerlift.bench.stores import LinkStores, Point, pool_bytes, store_bytes
from layerlift.bench.ttft_args import DEFAULT_EMULATED, build_parser, links, resolve_grid
from layerlift.engine.api import Engine
from layerlift.engine.config import EngineConfig
from layerlift.engine.results import PrefillResult
from layerlift.overlap.link import parse_link
from layerlift.pools.spec import ModelSpec
from layerlift.testing.kl import kl_divergence
from layerlift.testing.netns import netns_available

__all__ = ["DEFAULT_EMULATED", "build_parser", "main", "run_bench"]

CORES_NOTE = (
    "note: on this machine the real Mooncake links (loopback TCP, and TCP between namespace "
    "hosts) and the forward share {cores} CPU core(s); the emulated link models a NIC that "
    "costs no CPU, which is why it is there (and stands in where namespaces are unavailable)."
)


def _prompts(vocab: int, pt: Point, seed: int) -> tuple[list[np.ndarray], list[np.ndarray]]:
    rng = np.random.default_rng(seed)
    full = [rng.integers(0, vocab, pt.prefix + pt.suffix, dtype=np.int64)
            for _ in range(pt.batch)]
    return [f[: pt.prefix] for f in full], full


def _profile(res: PrefillResult) -> tuple[list[float], list[float]]:
    """Per-layer load times a_l (from the issue, running max of the landing
    times) and compute times c_l of one run."""
    t = res.timings
    a, last = [], t.load_issued
    for landed in t.layer_landed:
        cur = max(last, landed) if landed > 0 else last
        a.append(cur - last)
        last = cur
    return a, list(t.layer_compute)


class _Progress:
    def __init__(self, total: int, enabled: bool) -> None:
        self.total, self.done, self.enabled = total, 0, enabled and total > 0
        self.t0 = time.perf_counter()

    def show(self, what: str) -> None:
        if not self.enabled:
            return
        width = 24
        fill = int(width * self.done / self.total)
        el = time.perf_counter() - self.t0
        sys.stderr.write(f"\r[{'#' * fill}{'.' * (width - fill)}] {self.done}/{self.total} "
                         f"{el:5.0f}s  {what[:70]:<70}")
        sys.stderr.flush()

    def step(self, what: str) -> None:
        self.done += 1
        self.show(what)

    def end(self) -> None:
        if self.enabled:
            sys.stderr.write("\n")
            sys.stderr.flush()


# ---------------------------------------------------------------------------- one link
async def _run_link(link: str, preset: str, points: list[Point], args: argparse.Namespace,
                    progress: _Progress) -> list[dict[str, Any]]:
    model = build_model(preset, device=args.device)
    spec = model.spec
    pool_size = pool_bytes(spec, points)
    stores = await asyncio.to_thread(LinkStores, link, store_bytes(spec, points))
    run_id = uuid.uuid4().hex[:8]
    label = link_label(link)
    out: list[dict[str, Any]] = []
    try:
        for k, pt in enumerate(points):
            ns = f"bench-{run_id}-{k}"

            def cfg(policy: str, namespace: str, offload: bool) -> EngineConfig:
                return EngineConfig(store="memory", policy=policy, device=args.device,
                                    pool_bytes=pool_size, namespace=namespace,
                                    offload=offload, link=stores.engine_link)

            engines = {
                "writer": Engine(model, cfg("overlap", ns, True), store=stores.store),  # type: ignore[arg-type]
                "recompute": Engine(model, cfg("overlap", ns + "-none", False), store=stores.store),  # type: ignore[arg-type]
                "barrier": Engine(model, cfg("barrier", ns, False), store=stores.store),  # type: ignore[arg-type]
                "overlap": Engine(model, cfg("overlap", ns, False), store=stores.store),  # type: ignore[arg-type]
            }
            started = []
            try:
                for e in engines.values():
                    await e.start()
                    started.append(e)
                out.append(await _run_point(label, link, pt, spec, engines, args, progress))
            finally:
                for e in reversed(started):
                    await e.close()
                stores.store.forget()
    finally:
        await asyncio.to_thread(stores.close)
    return out


async def _run_point(label: str, link: str, pt: Point, spec: ModelSpec, engines: dict[str, Engine],
                     args: argparse.Namespace, progress: _Progress) -> dict[str, Any]:
    desc = f"{label} {pt.preset} P={pt.prefix} S={pt.suffix} B={pt.batch}"
    progress.show(desc + " (round 0)")
    vocab = engines["writer"].model.vocab_size
    prefixes, prompts = _prompts(vocab, pt, seed=args.seed + pt.prefix * 7 + pt.batch)
    writer = engines["writer"]
    await writer.prefill(prefixes)
    report = await writer.wait_offloads()
    if not report.ok:
        raise RuntimeError(f"offload of the prefixes failed at {desc}: {report.errors[:2]}")
    writer.drop_device_cache()

    smp = Samples()
    expect_restore = {"recompute": 0, "barrier": pt.prefix, "overlap": pt.prefix}
    for rep in range(args.warmup + args.repeats):
        measured = rep >= args.warmup
        results: dict[str, list[PrefillResult]] = {}
        for s in rotated(STRATEGIES, rep):  # no strategy always runs first (warm caches)
            eng = engines[s]
            eng.drop_device_cache()
            before = machine_cpu.sample()
            results[s] = await eng.prefill(prompts)
            if measured:
                smp.machine[s].add(before, machine_cpu.sample())
        ref = results["recompute"]
        for s, res in results.items():
            for r in res:
                if r.fallback_reason or r.recomputed_after_failure:
                    smp.fallbacks.append(f"{s}: {r.fallback_reason}")
                if s != "recompute":
                    smp.restored.add(r.restored_tokens)
                    smp.computed.add(r.computed_tokens)
                if r.restored_tokens != expect_restore[s]:
                    smp.fallbacks.append(f"{s}: restored {r.restored_tokens} != {expect_restore[s]}")
            if s != "recompute":
                smp.max_kl = max(smp.max_kl, *(kl_divergence(a.next_token_logprobs, b.next_token_logprobs)
                                               for a, b in zip(ref, res, strict=True)))
        if measured:
            _record(smp, results)
        progress.show(f"{desc} rep {rep + 1}/{args.warmup + args.repeats}")
    progress.step(desc)

    return summarize(label, link, pt, args.repeats, args.warmup, smp)


def rotated(items: Sequence[str], shift: int) -> list[str]:
    """`items` rotated left by `shift`: repeat r starts with strategy r mod n."""
    k = shift % len(items)
    return [*items[k:], *items[:k]]


def _record(smp: Samples, results: dict[str, list[PrefillResult]]) -> None:
    """Add one measured repeat's timings and per-layer profiles to `smp`."""
    for s, res in results.items():
        smp.ttft[s].append(res[0].timings.ttft)
        smp.fstart[s].append(res[0].timings.forward_start)
    # Loads: the overlap run's per-layer profile (its loads never wait for the
    # forward); the barrier's one whole-object read gives its own load time.
    # Computes: the barrier run's (nothing overlaps them there).
    a, _ = _profile(results["overlap"][0])
    whole, c = _profile(results["barrier"][0])
    smp.prof_a.append(a)
    smp.prof_c.append(c)
    smp.barrier_load.append(sum(whole))
    t = results["overlap"][0].timings
    room = min(sum(a) - a[0], sum(c) - c[-1])
    if room > 1e-3:
        smp.paired.append((smp.ttft["barrier"][-1] - t.ttft) / room)
    smp.over_wait.append(list(t.layer_wait))
    smp.over_c.append(list(t.layer_compute))


# ---------------------------------------------------------------------------- CLI
_links = links  # the link list's parser (bench/replay.py uses it too)


def link_label(link: str) -> str:
    """How a link mode is named in the table."""
    if link.startswith("cluster:"):
        return "mooncake-tcp-cluster"
    emulated = parse_link(link)
    return emulated.label if emulated is not None else "mooncake-tcp-loopback"


async def run_bench(args: argparse.Namespace) -> list[dict[str, Any]]:
    """Run the grid of ``args`` (parsed by :func:`build_parser`); one dict per point."""
    points = [Point(pr, p, s, b) for pr in args.preset for b in args.batch for s in args.suffix
              for p in args.prefix]
    progress = _Progress(len(points) * len(args.links), not args.no_progress)
    out: list[dict[str, Any]] = []
    try:
        for link in args.links:
            if is_netns(link):
                out += await _run_netns(link, points, args)
                continue
            for preset in args.preset:
                mine = [p for p in points if p.preset == preset]
                out += await _run_link(link, preset, mine, args, progress)
    finally:
        progress.end()
    return out


async def _run_netns(link: str, points: list[Point],
                     args: argparse.Namespace) -> list[dict[str, Any]]:
    ok, why = netns_available()
    if not ok:
        twin = emulated_twin(link)
        print(f"note: skipping {link}: {why}; the emulated link at the same rate ({twin}) "
              "stands in for it", file=sys.stderr)
        return []
    segment = max(store_bytes(build_model(p).spec, [q for q in points if q.preset == p])
                  for p in args.preset)
    return await asyncio.to_thread(run_netns_link, link, args, segment)


def main(argv: Sequence[str] | None = None) -> int:
    ap = build_parser()
    args = ap.parse_args(argv)
    resolve_grid(args, ap)
    import os

    if args.threads is None and args.device == "cpu":
        args.threads = 1
    if args.threads:
        torch.set_num_threads(args.threads)
    cores = os.cpu_count() or 1
    t0 = time.perf_counter()
    points = asyncio.run(run_bench(args))
    wall = time.perf_counter() - t0
    meta = {"command": "layerlift bench ttft " + " ".join(sys.argv[1:] if argv is None else argv),
            "cores": cores, "device": args.device, "torch_threads": torch.get_num_threads(),
            "wall_s": wall, "repeats": args.repeats, "warmup": args.warmup,
            "links": args.links, "kl_tol": KL_TOL}
    print(HEADER)
    print(format_table(points))
    for note in table_notes(points):
        print(note)
    if args.device == "cpu":
        print(CORES_NOTE.format(cores=cores))
    for p in points:
        if not p["kl_ok"]:
            print(f"FLAG: {p['link']} P={p['prefix_tokens']} B={p['batch']}: max KL "
                  f"{p['max_kl']:.2e} > {KL_TOL:g}")
        if not p["restore_ok"]:
            print(f"FLAG: {p['link']} P={p['prefix_tokens']} B={p['batch']}: {p['problems']}")
    print(f"wall time {wall:.1f} s")
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps({"meta": meta, "points": points}, indent=1))
    if args.markdown:
        Path(args.markdown).parent.mkdir(parents=True, exist_ok=True)
        Path(args.markdown).write_text(format_markdown(points, meta))
    if args.plot:
        write_plot(points, args.plot)
    ok = all(p["kl_ok"] and p["restore_ok"] for p in points)
    return 0 if ok else 1
