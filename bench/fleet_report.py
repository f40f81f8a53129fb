"""The fleet grid's record as figures a reader can check: every figure from
repeated runs with its interval, the noise floor beside the comparisons.

A grid record (``bench/fleet_grid.py``) holds one replay record per
setting, cell (instances, router) and seed. Within one seed every policy
(and every router) serves the same requests in the same order, so a
comparison of two configurations is *paired*: its interval comes from
resampling requests within each seed, the same requests for both
(:func:`~layerlift.bench.stats.paired_ratio_ci`). A ratio whose 95 %
interval spans 1 is written "no measurable difference". The noise floor is
the same comparison between two configurations that are identical: the
device-only policy (no store, no link) at the two GPU settings.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from layerlift.bench.stats import paired_ratio_ci, percentile_ci, verdict

__all__ = ["comparisons", "grouped", "noise_floor", "render", "render_targets", "targets"]

Record = dict[str, Any]
NOISE = ("gpu-rdma", "gpu-tcp25")  # device-only is the same configuration in both


def grouped(rows: Sequence[Record]) -> dict[tuple[int, str], list[Record]]:
    """Rows by (instances, router), one row per seed, in seed order."""
    out: dict[tuple[int, str], list[Record]] = {}
    for r in rows:
        out.setdefault((r["fleet"]["instances"], r["fleet"]["router"]), []).append(r)
    for cell in out.values():
        cell.sort(key=lambda r: r["scaling"]["seed"])
    return out


def _ttfts(cell: Sequence[Record], policy: str) -> list[list[float]] | None:
    if not cell or any(policy not in r["ttft_s"] for r in cell):
        return None
    return [list(r["ttft_s"][policy]) for r in cell]


def _pair(num: Sequence[Record], den: Sequence[Record], pn: str, pd: str,
          q: float) -> tuple[float, float, float] | None:
    """The paired ratio of policy ``pn`` in cell ``num`` over ``pd`` in
    ``den`` at percentile ``q``, over the seeds both ran."""
    seeds = {r["scaling"]["seed"] for r in num} & {r["scaling"]["seed"] for r in den}
    a = _ttfts([r for r in num if r["scaling"]["seed"] in seeds], pn)
    b = _ttfts([r for r in den if r["scaling"]["seed"] in seeds], pd)
    if a is None or b is None or [len(x) for x in a] != [len(x) for x in b]:
        return None
    return paired_ratio_ci(a, b, q)


def _entry(setting: str, where: str, what: str, q: int,
           got: tuple[float, float, float] | None, seeds: int) -> Record | None:
    if got is None:
        return None
    point, lo, hi = got
    return {"setting": setting, "where": where, "what": what, "q": q, "value": point,
            "lo": lo, "hi": hi, "verdict": verdict(lo, hi), "seeds": seeds}


def comparisons(record: Record) -> list[Record]:
    """Every paired comparison the grid supports, p50 and p90: overlap and
    its variants against the barrier / overlap, and at the largest fleet
    each router against round-robin and restore-aware against prefix."""
    out: list[Record] = []
    pairs = [("device-only", "barrier"), ("overlap", "barrier"),
             ("overlap+prefetch", "barrier"), ("overlap+auto", "barrier"),
             ("overlap+prefetch", "overlap"), ("overlap+auto", "overlap"),
             ("overlap+auto", "device-only"), ("overlap", "device-only")]
    for name, rows in record["settings"].items():
        by = grouped(rows)
        top = max(n for n, _ in by)
        for (n, router), cell in by.items():
            for pn, pd in pairs:
                for q in (50, 90):
                    e = _entry(name, f"{n}x {router}", f"{pn} / {pd}", q,
                               _pair(cell, cell, pn, pd, q), len(cell))
                    if e is not None:
                        out.append(e)
        rr = by.get((top, "round-robin"))
        for (n, router), cell in by.items():
            if n != top or router == "round-robin" or rr is None:
                continue
            refs = [("round-robin", rr)]
            if router == "restore-aware" and (top, "prefix") in by:
                refs.append(("prefix", by[(top, "prefix")]))
            for ref, other in refs:
                for q in (50, 90):
                    e = _entry(name, f"{n}x overlap", f"{router} / {ref}", q,
                               _pair(cell, other, "overlap", "overlap", q), len(cell))
                    if e is not None:
                        out.append(e)
    return out


def noise_floor(record: Record) -> list[Record]:
    """Device-only at gpu-rdma over device-only at gpu-tcp25 (identical
    configurations: no store, no link), per cell, p50 and p90."""
    s = record["settings"]
    if not all(k in s for k in NOISE):
        return []
    a, b = grouped(s[NOISE[0]]), grouped(s[NOISE[1]])
    out = []
    for key in a:
        if key not in b:
            continue
        for q in (50, 90):
            e = _entry("noise", f"{key[0]}x {key[1]}", "device-only rdma / tcp25", q,
                       _pair(a[key], b[key], "device-only", "device-only", q), len(a[key]))
            if e is not None:
                out.append(e)
    return out


def _ci(groups: list[list[float]] | None, q: int) -> str:
    if groups is None:
        return "-"
    p, lo, hi = percentile_ci(groups, q)
    return f"{p * 1e3:.0f} [{lo * 1e3:.0f}, {hi * 1e3:.0f}]"


def _ratio(e: Record | None) -> str:
    return "-" if e is None else f"{e['value']:.2f} [{e['lo']:.2f}, {e['hi']:.2f}]"


def _per_req(cell: Sequence[Record], pol: str, key: str, field: str) -> float | None:
    vals = [(r["details"][pol].get(key) or {}).get(field) for r in cell]
    if any(v is None for v in vals):
        return None
    requests = sum(int(r["scaling"]["requests"]) for r in cell)
    return sum(float(v) for v in vals if v is not None) / requests


def _busy(cell: Sequence[Record], pol: str) -> float | None:
    """Modeled GPU seconds over the instances' served seconds (measured)."""
    num = den = 0.0
    for r in cell:
        fc = r["details"][pol].get("forward_clock")
        if not fc:
            return None
        num += fc["modeled_s"]
        den += r["policies"][pol].get("served_s", 0.0) * r["fleet"]["instances"]
    return num / den if den > 0 else None


def _fmt(x: float | None, scale: float = 1.0, nd: int = 0) -> str:
    return "-" if x is None else f"{x * scale:.{nd}f}"


def _setting_table(name: str, rows: Sequence[Record], comps: Sequence[Record]) -> list[str]:
    by = grouped(rows)
    first = rows[0]
    st, sc = first["setting"], first["scaling"]
    k = st["token_scale"]
    pol0 = next(iter(first["policies"].values()))
    offered = pol0.get("offered_tokens_per_s", pol0["prompt_tokens_per_s"]) * k
    seeds = sorted({r["scaling"]["seed"] for r in rows})
    vs = {(c["where"], c["what"], c["q"]): c for c in comps if c["setting"] == name}
    lines = [f"## {name}: {st['profile']}, links {', '.join(st['links'])}, token scale {k}, "
             f"SLO {first['fleet']['slo_ms']:g} ms", "",
             f"![{name}]({name}.png)", "",
             f"Seeds {', '.join(map(str, seeds))} (each samples its own ~{sc['requests']} "
             f"requests); offered load ~{offered:,.0f} real prompt tokens/s (the trace's "
             "arrival rate: an input, the same in every row). Intervals: 95 % bootstrap over "
             "requests within seeds; ratios are paired (same requests).", "",
             "| inst | router | policy | p50 ms [CI] | p90 ms [CI] | p50 / barrier | "
             "p90 / barrier | in SLO | restored % | GPU busy % | charged read ms/req | "
             "host ms/req | loop lag p99 ms | max KL |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for (n, router), cell in by.items():
        for pol in cell[0]["policies"]:
            tok = [r["policies"][pol]["tokens"] for r in cell]
            restored = sum(t["restored"] for t in tok) / sum(sum(t.values()) for t in tok)
            slo = sum(r["policies"][pol]["within_slo_fraction"] for r in cell) / len(cell)
            lag = max(r["details"][pol]["loop_lag"]["arrival_p99_s"] for r in cell)
            kl = max(r["details"][pol]["max_kl"] for r in cell)
            where = f"{n}x {router}"
            lines.append(
                f"| {n} | {router} | {pol} | {_ci(_ttfts(cell, pol), 50)} | "
                f"{_ci(_ttfts(cell, pol), 90)} | "
                f"{_ratio(vs.get((where, f'{pol} / barrier', 50)))} | "
                f"{_ratio(vs.get((where, f'{pol} / barrier', 90)))} | {slo:.2f} | "
                f"{100 * restored:.1f} | {_fmt(_busy(cell, pol), 100)} | "
                f"{_fmt(_per_req(cell, pol, 'host_cost', 'read_host_s'), 1e3, 1)} | "
                f"{_fmt(_per_req(cell, pol, 'forward_clock', 'host_s'), 1e3, 1)} | "
                f"{lag * 1e3:.0f} | {kl:.0e} |")
    return [*lines, ""]


def _comparison_table(title: str, comps: Sequence[Record]) -> list[str]:
    if not comps:
        return []
    lines = [f"## {title}", "", "| setting | where | ratio | pct | value [95 % CI] | reading |",
             "|---|---|---|---|---|---|"]
    for c in comps:
        lines.append(f"| {c['setting']} | {c['where']} | {c['what']} | p{c['q']} | "
                     f"{_ratio(c)} | {c['verdict']} |")
    return [*lines, ""]


def render(record: Record) -> str:
    """The grid as Markdown: the noise floor, one table per setting, the
    paired comparisons and the targets, every figure with its interval."""
    comps = comparisons(record)
    noise = noise_floor(record)
    meta = record["meta"]
    lines = ["# Fleet grid (simulated)", "", f"`{meta['command']}`", "",
             "Every row is simulated: the real engine, server, tree, pools, store and "
             "emulated link, with the simulated model's compute time (see "
             "`engine/model/simulated.py`, `docs/roofline.md`). Host work the token scale "
             "leaves out (CRC checks, copies) is charged at this machine's rates and offload "
             "puts go through an emulated egress NIC (`bench/hostcost.py`); TTFT includes "
             "host time (the event loop, threads: the *host ms/req* and *loop lag* columns). "
             "*GPU busy* is measured: modeled GPU seconds over the instances' serving time.",
             ""]
    if "load_average" in meta:
        la = meta["load_average"]
        lines += [f"Wall time {meta.get('wall_s', 0) / 60:.0f} min; load average (1 min) at "
                  f"start {la['start'][0]:.2f}, end {la['end'][0]:.2f} on "
                  f"{meta.get('cpus', '?')} CPUs (shared with other work).", ""]
    if meta.get("note"):
        lines += [f"Note: {meta['note']}", ""]
    if noise:
        spread = [x for e in noise for x in (e["lo"], e["hi"])]
        lines += _comparison_table("Noise floor: identical configurations", noise)
        lines += [f"Identical configurations differ by {min(spread):.2f} to {max(spread):.2f}x "
                  "within their 95 % intervals: a ratio inside that band is not a finding.",
                  ""]
    for name, rows in record["settings"].items():
        lines += _setting_table(name, rows, comps)
    lines += _comparison_table("Paired comparisons (those against the barrier are in the "
                               "tables above)",
                               [c for c in comps if not c["what"].endswith("/ barrier")])
    lines += render_targets(targets(record, comps))
    return "\n".join(lines) + "\n"


def targets(record: Record, comps: Sequence[Record] | None = None) -> list[Record]:
    """The issue's targets per setting and grid point, each met only when
    its whole 95 % interval is on the right side of the bound ("within
    noise" when only the point is)."""
    comps = comparisons(record) if comps is None else comps
    by_key = {(c["setting"], c["where"], c["what"], c["q"]): c for c in comps}
    out: list[Record] = []

    def add(target: str, where: str, c: Record | None, bound: float) -> None:
        if c is None:
            return
        met = "yes" if c["hi"] <= bound else "within noise" if c["value"] <= bound else "no"
        out.append({"target": target, "where": where, "value": c["value"], "lo": c["lo"],
                    "hi": c["hi"], "bound": bound, "met": met})

    for name, rows in record["settings"].items():
        by = grouped(rows)
        top = max(n for n, _ in by)
        rr = by.get((top, "round-robin"))
        if rr is not None and _ttfts(rr, "overlap") is not None:
            tok = [r["policies"]["overlap"]["tokens"] for r in rr]
            frac = sum(t["restored"] for t in tok) / sum(sum(t.values()) for t in tok)
            out.append({"target": "restored >= 25 % of prompt tokens (largest fleet, "
                        "round-robin, overlap)", "where": name, "value": frac, "lo": frac,
                        "hi": frac, "bound": 0.25, "met": "yes" if frac >= 0.25 else "no"})
        for (n, router) in by:
            where = f"{n}x {router}"
            if name == "gpu-tcp25":
                add("overlap p90 <= 0.9 x barrier p90", f"{name} {where}",
                    by_key.get((name, where, "overlap / barrier", 90)), 0.9)
            add("overlap+prefetch p90 <= overlap p90", f"{name} {where}",
                by_key.get((name, where, "overlap+prefetch / overlap", 90)), 1.0)
            for ref in ("overlap", "device-only"):  # <= 1.05 x the min of the two
                add(f"overlap+auto p90 <= 1.05 x {ref} p90", f"{name} {where}",
                    by_key.get((name, where, f"overlap+auto / {ref}", 90)), 1.05)
        for ref, bound in (("prefix", 1.0), ("round-robin", 0.8)):
            add(f"restore-aware p90 <= {bound:g} x {ref} p90", f"{name} {top}x overlap",
                by_key.get((name, f"{top}x overlap", f"restore-aware / {ref}", 90)), bound)
    return out


def render_targets(checks: Sequence[Record]) -> list[str]:
    lines = ["## Targets", "", "| target | where | measured [95 % CI] | bound | met |",
             "|---|---|---|---|---|"]
    for c in checks:
        shown = "yes" if c["met"] == "yes" else f"**{c['met']}**"
        lines.append(f"| {c['target']} | {c['where']} | {c['value']:.2f} [{c['lo']:.2f}, "
                     f"{c['hi']:.2f}] | {c['bound']:g} | {shown} |")
    met = sum(c["met"] == "yes" for c in checks)
    lines += ["", f"{met} of {len(checks)} checks met with their whole interval.", ""]
    return lines
