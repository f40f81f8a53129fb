"""`layerlift bench ttft`: time to first token of recompute, barrier restore and
overlap restore on the same prompts (DESIGN.md section 5).

Per link mode and model preset the harness opens ONE store shared by four engines:

* ``writer``    (policy overlap, offload on,  namespace A): computes each point's prefixes
  once (round 0) and offloads them; ``wait_offloads()`` before measuring.
* ``recompute`` (offload off, namespace B): nothing in the store matches, so the whole
  prompt is computed (its lookup is a miss: a cheap ``exists`` call).
* ``barrier``   (policy barrier, offload off, namespace A): the forward starts when every
  layer has landed.
* ``overlap``   (policy overlap, offload off, namespace A): layer l waits for layer l only.

The measuring engines never offload, so the store holds exactly the prefixes and every
restore is of ``prefix_tokens`` tokens. Each repeat runs the three strategies back to back
(interleaved), each after ``drop_device_cache()``; TTFT is ``result.timings.ttft`` (from the
``prefill`` call to the next-token distribution). After a point its keys are removed.

Link modes: ``mooncake`` — one ``mooncake_master`` started here, one client that holds the
segment (``global_segment_size``) and one pure client (segment 0) that the engines share,
so every restore is a real Mooncake TCP transfer over loopback; ``emulated:GBPS[,LAT_US]``
— a shared in-process ``MemoryStore`` whose fetches copy the real bytes into the pools and
then sleep until a modeled NIC would have delivered them (costs no CPU).

Per-layer profile (from the barrier run, where loading and computing never overlap):
``A_l`` = when layer l landed minus when the loads were issued (running max), ``a_l`` =
``A_l - A_{l-1}``, ``c_l`` = the barrier forward's ``layer_compute``. ``load_s = Σa``,
``compute_s = Σc``. The fixed overhead ``T_barrier - Σa - Σc`` (lookup, PREPARE, issuing,
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
import contextlib
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

from layerlift.engine.api import Engine
from layerlift.engine.config import EngineConfig
from layerlift.engine.model import HybridModel
from layerlift.engine.results import PrefillResult
from layerlift.linker.memory_store import MemoryStore
from layerlift.overlap.link import parse_link
from layerlift.pools.spec import Component, ModelSpec

__all__ = ["DEFAULT_EMULATED", "main", "run_bench"]

STRATEGIES = ("recompute", "barrier", "overlap")
# Chosen on the 2-core CPU machine (torch 1 thread) for preset "small", suffix 64, batch 1:
# the suffix forward takes ~130-150 ms there, the restore of P = 512 / 1024 / 2048 tokens
# moves ~8 / 13 / 21 MB, so 0.1 GB/s puts Σa at ~0.6x / 1x / 1.5x of Σc (within 2x).
# On a GPU the forward is far faster: pass a faster link there (e.g. emulated:25,5).
DEFAULT_EMULATED = "emulated:0.1,10"
KL_TOL = 1e-9
CORES_NOTE = (
    "note: on this machine the real Mooncake link (loopback TCP) and the forward share "
    "{cores} CPU core(s); the emulated link models a NIC that costs no CPU."
)


@dataclass(frozen=True, slots=True)
class Point:
    preset: str
    prefix: int
    suffix: int
    batch: int


# ---------------------------------------------------------------------------- stores
class _TrackingStore:
    """Delegates to a store and remembers the keys put, so a point can be removed."""

    def __init__(self, inner: Any) -> None:
        self._inner = inner
        self.put_keys: list[str] = []

    def put(self, keys: Sequence[str], *args: Any, **kw: Any) -> Any:
        out = self._inner.put(keys, *args, **kw)
        self.put_keys.extend(keys)
        return out

    def forget(self) -> None:
        keys, self.put_keys = self.put_keys, []
        for i in range(0, len(keys), 512):
            # a lease still held refuses it: harmless, the keys are namespaced per point
            with contextlib.suppress(Exception):
                self._inner.remove(keys[i:i + 512])

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


class _LinkStores:
    """The store(s) of one link mode; ``store`` is what the engines get injected."""

    def __init__(self, link: str, segment_bytes: int) -> None:
        self.link = link
        self.master = None
        self._closers: list[Any] = []
        if parse_link(link) is None:  # mooncake
            from layerlift.linker.master import EmbeddedMaster
            from layerlift.linker.mooncake_store import MooncakeStore

            # A read lease covers a whole batch's restore (all layers, read while the
            # forward runs): the embedded default of 50 ms expires mid-restore on a busy
            # 2-core machine (LEASE_EXPIRED), so give it seconds, as `layerlift master` does.
            self.master = EmbeddedMaster(lease_ttl_ms=5000).start()
            try:
                holder = MooncakeStore(self.master.config(global_segment_size=segment_bytes,
                                                          timeout_s=60.0))
                self._closers.append(holder)
                client = MooncakeStore(self.master.config(global_segment_size=0,
                                                          local_buffer_size=16 << 20,
                                                          timeout_s=60.0))
                self._closers.insert(0, client)
            except BaseException:
                self.close()
                raise
            inner: Any = client
            self.engine_link: str | None = None
        else:
            inner = MemoryStore(timeout_s=60.0)
            self._closers.append(inner)
            self.engine_link = link
        self.store = _TrackingStore(inner)

    def close(self) -> None:
        for s in self._closers:
            with contextlib.suppress(Exception):
                s.close()
        self._closers.clear()
        if self.master is not None:
            self.master.stop()
            self.master = None


# ---------------------------------------------------------------------------- helpers
def _pool_bytes(spec: ModelSpec, points: Sequence[Point]) -> int:
    need = 0
    for p in points:
        pages = p.batch * (math.ceil((p.prefix + p.suffix) / spec.page_size) + 2)
        per = spec.page_bytes(Component.FULL) + spec.page_bytes(Component.SWA)
        slots = p.batch * (3 + (p.prefix + p.suffix) // spec.track_interval + 2)
        need = max(need, 2 * pages * per + slots * spec.page_bytes(Component.MAMBA))
    return need + (8 << 20)


def _store_bytes(spec: ModelSpec, points: Sequence[Point]) -> int:
    per_tok = (spec.page_bytes(Component.FULL) + spec.page_bytes(Component.SWA)) / spec.page_size
    # every point's prefixes (removal after a point may be refused while a lease is held)
    toks = sum(p.batch * p.prefix for p in points)
    ckpt = sum(p.batch * (p.prefix // spec.track_interval + 1) for p in points)
    return int(1.25 * (toks * per_tok + ckpt * spec.page_bytes(Component.MAMBA))) + (64 << 20)


def _prompts(spec: ModelSpec, pt: Point, seed: int) -> tuple[list[np.ndarray], list[np.ndarray]]:
    rng = np.random.default_rng(seed)
    full = [rng.integers(0, spec.vocab_size, pt.prefix + pt.suffix, dtype=np.int64)
            for _ in range(pt.batch)]
    return [f[: pt.prefix] for f in full], full


def _kl(ref: PrefillResult, got: PrefillResult) -> float:
    # renormalise in float64: the float32 log-probs are normalised only to ~1e-7, which
    # would otherwise dominate the first-order term of the KL
    lp = torch.log_softmax(ref.next_token_logprobs.double(), -1)
    lq = torch.log_softmax(got.next_token_logprobs.double(), -1)
    return float((lp.exp() * (lp - lq)).sum().clamp_min(0.0))


def _pct(xs: Sequence[float], q: float) -> float:
    return float(np.percentile(np.asarray(xs, dtype=np.float64), q))


def _profile(res: PrefillResult) -> tuple[list[float], list[float]]:
    """Per-layer load times a_l and compute times c_l of a barrier run."""
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
    spec = ModelSpec.preset(preset)
    model = HybridModel(spec, seed=0, device=args.device)
    pool_bytes = _pool_bytes(spec, points)
    stores = await asyncio.to_thread(_LinkStores, link, _store_bytes(spec, points))
    run_id = uuid.uuid4().hex[:8]
    label = parse_link(link).label if parse_link(link) else "mooncake-tcp-loopback"  # type: ignore[union-attr]
    out: list[dict[str, Any]] = []
    try:
        for k, pt in enumerate(points):
            ns = f"bench-{run_id}-{k}"

            def cfg(policy: str, namespace: str, offload: bool) -> EngineConfig:
                return EngineConfig(store="memory", policy=policy, device=args.device,
                                    pool_bytes=pool_bytes, namespace=namespace,
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
    prefixes, prompts = _prompts(spec, pt, seed=args.seed + pt.prefix * 7 + pt.batch)
    writer = engines["writer"]
    await writer.prefill(prefixes)
    report = await writer.wait_offloads()
    if not report.ok:
        raise RuntimeError(f"offload of the prefixes failed at {desc}: {report.errors[:2]}")
    writer.drop_device_cache()

    ttft: dict[str, list[float]] = {s: [] for s in STRATEGIES}
    fstart: dict[str, list[float]] = {s: [] for s in STRATEGIES}
    prof_a: list[list[float]] = []
    prof_c: list[list[float]] = []
    over_wait: list[list[float]] = []
    over_c: list[list[float]] = []
    paired: list[float] = []  # per-repeat efficiency: barrier and overlap of the same repeat
    room_i = 0.0
    max_kl = 0.0
    restored: set[int] = set()
    computed: set[int] = set()
    fallbacks: list[str] = []
    expect_restore = {"recompute": 0, "barrier": pt.prefix, "overlap": pt.prefix}
    for rep in range(args.warmup + args.repeats):
        measured = rep >= args.warmup
        ref: list[PrefillResult] | None = None
        for s in STRATEGIES:
            eng = engines[s]
            eng.drop_device_cache()
            res = await eng.prefill(prompts)
            if s == "recompute":
                ref = res
            for r in res:
                if r.fallback_reason or r.recomputed_after_failure:
                    fallbacks.append(f"{s}: {r.fallback_reason}")
                if s != "recompute":
                    restored.add(r.restored_tokens)
                    computed.add(r.computed_tokens)
                if r.restored_tokens != expect_restore[s]:
                    fallbacks.append(f"{s}: restored {r.restored_tokens} != {expect_restore[s]}")
            assert ref is not None
            if s != "recompute":
                max_kl = max(max_kl, *(_kl(a, b) for a, b in zip(ref, res, strict=True)))
            if not measured:
                continue
            t = res[0].timings
            ttft[s].append(t.ttft)
            fstart[s].append(t.forward_start)
            if s == "barrier":
                a, c = _profile(res[0])
                prof_a.append(a)
                prof_c.append(c)
                room_i = min(sum(a) - a[0], sum(c) - c[-1])
            elif s == "overlap":
                if room_i > 1e-3:
                    paired.append((ttft["barrier"][-1] - t.ttft) / room_i)
                over_wait.append(list(t.layer_wait))
                over_c.append(list(t.layer_compute))
        progress.show(f"{desc} rep {rep + 1}/{args.warmup + args.repeats}")
    progress.step(desc)

    p50 = {s: _pct(ttft[s], 50) for s in STRATEGIES}
    p90 = {s: _pct(ttft[s], 90) for s in STRATEGIES}
    a_med = np.median(np.asarray(prof_a), axis=0)
    c_med = np.median(np.asarray(prof_c), axis=0)
    load_s, compute_s = float(a_med.sum()), float(c_med.sum())
    overhead = p50["barrier"] - load_s - compute_s
    ideal = max(load_s + float(c_med[-1]), float(a_med[0]) + compute_s)
    bound = overhead + ideal
    room = p50["barrier"] - bound
    eff = (p50["barrier"] - p50["overlap"]) / room if room > 1e-3 else None
    # the recurrence F_l = max(A_l, F_{l-1}) + c_l with the measured a and c
    f_l = 0.0
    for a_l, c_l in zip(np.cumsum(a_med), c_med, strict=True):
        f_l = max(float(a_l), f_l) + float(c_l)
    w_med = np.median(np.asarray(over_wait), axis=0)
    oc_med = np.median(np.asarray(over_c), axis=0)
    return {
        "link": label,
        "link_arg": link,
        "preset": pt.preset,
        "prefix_tokens": pt.prefix,
        "suffix_tokens": pt.suffix,
        "batch": pt.batch,
        "repeats": args.repeats,
        "warmup": args.warmup,
        "ttft_s": p50,
        "ttft_p90_s": p90,
        "ttft_all_s": ttft,
        "load_s": load_s,
        "compute_s": compute_s,
        "overhead_s": overhead,
        "bound_s": bound,
        "model_overlap_s": overhead + f_l,
        "efficiency": eff,
        "efficiency_paired": float(np.median(paired)) if paired else None,
        # against what per-layer overlap can reach for this per-layer profile (the
        # recurrence), not the looser bound: how much of the achievable gain was had
        "efficiency_model": _ratio(p50["barrier"] - p50["overlap"],
                                   p50["barrier"] - (overhead + f_l)),
        "load_compute_ratio": load_s / compute_s if compute_s > 0 else None,
        "speedup": p50["barrier"] / p50["overlap"] if p50["overlap"] > 0 else None,
        "speedup_vs_recompute": p50["recompute"] / p50["overlap"] if p50["overlap"] > 0 else None,
        "overlap_slower_pct": 100.0 * (p50["overlap"] / p50["barrier"] - 1.0),
        "forward_start_s": {s: _pct(fstart[s], 50) for s in ("barrier", "overlap")},
        "overlap_wait_first_s": float(w_med[0]),
        "overlap_wait_rest_s": float(w_med[1:].sum()),
        "overlap_compute_s": float(oc_med.sum()),
        "layer_load_s": [float(x) for x in a_med],
        "layer_compute_s": [float(x) for x in c_med],
        "overlap_layer_wait_s": [float(x) for x in w_med],
        "restored_tokens": sorted(restored)[0] if len(restored) == 1 else sorted(restored),
        "computed_tokens": sorted(computed)[0] if len(computed) == 1 else sorted(computed),
        "expected_restored_tokens": pt.prefix,
        "restore_ok": not fallbacks,
        "problems": fallbacks[:5],
        "max_kl": max_kl,
        "kl_ok": max_kl <= KL_TOL,
    }


# ---------------------------------------------------------------------------- output
def _ms(x: float | None) -> str:
    return "-" if x is None else f"{1e3 * x:.1f}"


def _f(x: float | None, nd: int = 2) -> str:
    return "-" if x is None else f"{x:.{nd}f}"


COLUMNS = ("link", "preset", "P", "S", "B", "recomp ms", "barrier ms", "overlap ms",
           "p90 b/o ms", "load ms", "compute ms", "a/c", "bound ms", "fwd start b/o ms",
           "model ms", "eff", "eff pair", "eff model", "speedup", "restored", "computed",
           "max KL", "ok")


def _ratio(num: float, den: float) -> float | None:
    return num / den if den > 1e-3 else None


def _row(p: dict[str, Any]) -> list[str]:
    t, t9, fs = p["ttft_s"], p["ttft_p90_s"], p["forward_start_s"]
    ok = p["kl_ok"] and p["restore_ok"]
    return [p["link"], p["preset"], str(p["prefix_tokens"]), str(p["suffix_tokens"]),
            str(p["batch"]), _ms(t["recompute"]), _ms(t["barrier"]), _ms(t["overlap"]),
            f"{_ms(t9['barrier'])}/{_ms(t9['overlap'])}", _ms(p["load_s"]),
            _ms(p["compute_s"]), _f(p["load_compute_ratio"]), _ms(p["bound_s"]),
            f"{_ms(fs['barrier'])}/{_ms(fs['overlap'])}", _ms(p["model_overlap_s"]),
            _f(p["efficiency"]), _f(p["efficiency_paired"]), _f(p["efficiency_model"]),
            _f(p["speedup"]), str(p["restored_tokens"]), str(p["computed_tokens"]),
            f"{p['max_kl']:.1e}", "yes" if ok else "NO"]


def format_table(points: Sequence[dict[str, Any]]) -> str:
    rows = [list(COLUMNS)] + [_row(p) for p in points]
    widths = [max(len(r[i]) for r in rows) for i in range(len(COLUMNS))]
    lines = ["  ".join(c.rjust(w) for c, w in zip(r, widths, strict=True)) for r in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def format_markdown(points: Sequence[dict[str, Any]], meta: dict[str, Any]) -> str:
    out = ["# LayerLift TTFT benchmark", "",
           f"- command: `{meta['command']}`",
           f"- machine: {meta['cores']} CPU core(s), device `{meta['device']}`, "
           f"torch threads {meta['torch_threads']}; wall time {meta['wall_s']:.0f} s",
           f"- TTFT p50 over {meta['repeats']} repeats after {meta['warmup']} warm-up; "
           "strategies interleaved per repeat on the same prompts",
           "- link `mooncake-tcp-loopback`: real Mooncake transfers over loopback TCP "
           "(they share the CPU cores with the forward); `emulated:…`: a modeled NIC "
           "(real bytes, no CPU cost)",
           "- load/compute: per-layer profile of the barrier run; bound = overhead + "
           "max(Σa + c_last, a_0 + Σc), overhead = T_barrier − Σa − Σc; "
           "eff = (T_barrier − T_overlap)/(T_barrier − bound)", "",
           "| " + " | ".join(COLUMNS) + " |",
           "|" + "|".join("---" for _ in COLUMNS) + "|"]
    out += ["| " + " | ".join(_row(p)) + " |" for p in points]
    return "\n".join(out) + "\n"


def write_plot(points: Sequence[dict[str, Any]], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    links = list(dict.fromkeys(p["link"] for p in points))
    fig, axes = plt.subplots(1, len(links), figsize=(6 * len(links), 4.5), squeeze=False)
    colors = {"recompute": "tab:gray", "barrier": "tab:red", "overlap": "tab:blue",
              "bound": "tab:green"}
    styles = ["-", "--", ":", "-."]
    for ax, link in zip(axes[0], links, strict=True):
        mine = [p for p in points if p["link"] == link]
        groups = list(dict.fromkeys((p["preset"], p["suffix_tokens"], p["batch"]) for p in mine))
        for gi, g in enumerate(groups):
            pts = sorted((p for p in mine if (p["preset"], p["suffix_tokens"], p["batch"]) == g),
                         key=lambda p: p["prefix_tokens"])
            x = [p["prefix_tokens"] for p in pts]
            tag = f"{g[0]} S={g[1]} B={g[2]}"
            ls = styles[gi % len(styles)]
            for s in STRATEGIES:
                ax.plot(x, [1e3 * p["ttft_s"][s] for p in pts], ls, marker="o",
                        color=colors[s], label=f"{s} ({tag})")
            ax.plot(x, [1e3 * p["bound_s"] for p in pts], ls, marker="x", color=colors["bound"],
                    alpha=0.7, label=f"bound ({tag})")
        ax.set_title(f"link: {link}")
        ax.set_xlabel("prefix tokens (restored)")
        ax.set_ylabel("TTFT p50 (ms)")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")  # recompute dwarfs the restores on a linear axis
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=6)
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)


# ---------------------------------------------------------------------------- CLI
QUICK = dict(preset=["small"], prefix=[512, 1024, 2048], suffix=[64], batch=[1],
             repeats=3, warmup=1)
# ~9 min on the 2-core box (recompute of 4096 x 2 tokens dominates); medium, longer
# suffixes and batch 4 are available through the options.
FULL = dict(preset=["small"], prefix=[512, 1024, 2048, 4096], suffix=[64],
            batch=[1, 2], repeats=5, warmup=1)


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.replace(" ", "").split(",") if x]


def _strs(text: str) -> list[str]:
    return [x for x in text.replace(" ", "").split(",") if x]


def _links(text: str) -> list[str]:
    """'mooncake,emulated:2,10,emulated:1' -> ['mooncake', 'emulated:2,10', 'emulated:1']."""
    out: list[str] = []
    for part in _strs(text):
        if part == "mooncake" or part.startswith("emulated:"):
            out.append(part)
        elif out and out[-1].startswith("emulated:") and out[-1].count(",") == 0:
            out[-1] += "," + part  # the latency of the previous emulated link
        else:
            raise ValueError(f"bad link list {text!r}: use e.g. 'mooncake,emulated:2,10'")
    for link in out:
        parse_link(link)  # validates
    return out


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="layerlift bench ttft",
        description="TTFT of recompute vs barrier restore vs overlap restore (p50/p90).",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--preset", type=_strs, default=None,
                    help=f"model preset(s), comma separated; one of {ModelSpec.preset_names()} "
                         f"(default {','.join(FULL['preset'])})")  # type: ignore[arg-type]
    ap.add_argument("--prefix", type=_ints, default=None, help="prefix lengths (restored tokens)")
    ap.add_argument("--suffix", type=_ints, default=None, help="suffix lengths (computed tokens)")
    ap.add_argument("--batch", type=_ints, default=None, help="batch sizes")
    ap.add_argument("--repeats", type=int, default=None, help="measured repeats per point")
    ap.add_argument("--warmup", type=int, default=None, help="warm-up repeats per point")
    ap.add_argument("--links", type=_links, default=None,
                    help=f"link modes (default 'mooncake,{DEFAULT_EMULATED}')")
    ap.add_argument("--device", default="cpu", help="cpu or cuda[:N]")
    ap.add_argument("--quick", action="store_true",
                    help="small grid (small preset, P 512/1024/2048, S 64, B 1, 3 repeats)")
    ap.add_argument("--seed", type=int, default=0, help="prompt seed")
    ap.add_argument("--threads", type=int, default=None,
                    help="torch CPU threads (default: 1 on cpu, leaving a core to the link "
                         "and keeping timings stable on a shared 2-core machine)")
    ap.add_argument("--json", default=None, help="write the results as JSON here")
    ap.add_argument("--markdown", default=None, help="write a Markdown table here")
    ap.add_argument("--plot", default=None, help="write a PNG plot here (needs matplotlib)")
    ap.add_argument("--no-progress", action="store_true", help="no progress line on stderr")
    return ap


def _grid(args: argparse.Namespace) -> None:
    base = QUICK if args.quick else FULL
    for key in ("preset", "prefix", "suffix", "batch", "repeats", "warmup"):
        if getattr(args, key) is None:
            setattr(args, key, base[key])
    if args.links is None:
        args.links = ["mooncake", DEFAULT_EMULATED]
    if args.repeats < 1 or args.warmup < 0:
        raise SystemExit("error: --repeats must be >= 1 and --warmup >= 0")
    for p in args.preset:
        spec = ModelSpec.preset(p)
        for n in args.prefix:
            if n <= 0 or n % spec.track_interval:
                raise SystemExit(f"error: prefix {n} must be a positive multiple of preset {p}'s "
                                 f"track_interval ({spec.track_interval}) to be restorable whole")


async def run_bench(args: argparse.Namespace) -> list[dict[str, Any]]:
    """Run the grid of ``args`` (parsed by :func:`build_parser`); one dict per point."""
    points = [Point(pr, p, s, b) for pr in args.preset for b in args.batch for s in args.suffix
              for p in args.prefix]
    progress = _Progress(len(points) * len(args.links), not args.no_progress)
    out: list[dict[str, Any]] = []
    try:
        for link in args.links:
            for preset in args.preset:
                mine = [p for p in points if p.preset == preset]
                out += await _run_link(link, preset, mine, args, progress)
    finally:
        progress.end()
    return out


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    _grid(args)
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
    print(format_table(points))
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
