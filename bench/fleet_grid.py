"""The fleet grid: the conversation trace through 1-8 simulated instances
per router and policy, at three settings; one JSON record, a Markdown
page and one TTFT CDF per setting.

    layerlift bench fleet-grid --out bench/results/fleet/grid

Each cell is one ``layerlift bench replay`` run (its command line is in the
record); a cell runs every policy on the same sampled requests. Settings:

* ``gpu-rdma``: Nemotron-H-8B on one H100, one 400 Gbps RDMA NIC (45 GB/s),
  token scale 64 (28 cache layers: on two shared cores the host keeps up
  with it at 200x the trace's clock; Qwen3-Next's 48 layers it did not at
  400x);
* ``gpu-tcp25``: the same with 25 Gbit TCP NICs;
* ``cpu-measured``: the reference model's layout (preset ``tiny``) with the
  compute profile fitted on this machine, the replay's default emulated link.

What runs by default (2 cores shared, so the grid is cut; ``--full`` runs
everything): every policy at one instance and at the largest fleet with
round-robin; device-only, barrier and overlap elsewhere; at the largest
fleet the other routers with overlap; 60 requests.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from layerlift.bench import replay
from layerlift.bench.output import add_output_options, command_line

__all__ = ["SETTINGS", "cells", "main", "render", "targets"]

SETTINGS: dict[str, list[str]] = {
    "gpu-rdma": ["--model", "simulated", "--arch", "nemotron-h-8b", "--device", "h100",
                 "--network", "rdma", "--block-tokens", "8", "--batch-tokens", "256",
                 "--time-scale", "200", "--slo-ms", "500"],
    "gpu-tcp25": ["--model", "simulated", "--arch", "nemotron-h-8b", "--device", "h100",
                  "--network", "tcp25", "--block-tokens", "8", "--batch-tokens", "256",
                  "--time-scale", "200", "--slo-ms", "500"],
    "cpu-measured": ["--model", "simulated", "--arch", "reference", "--block-tokens", "16",
                     "--time-scale", "150", "--slo-ms", "1000"],
}


ALL = "device-only,barrier,overlap,overlap+prefetch,overlap+auto"
CUT = "device-only,barrier,overlap"


def cells(instances: Sequence[int], routers_small: Sequence[str],
          routers_big: Sequence[str], *, full: bool = False) -> list[tuple[int, str, str]]:
    """``(instances, router, policies)`` cells: one router for a single
    instance (they all pick it), ``routers_small`` below the largest fleet,
    ``routers_big`` at the largest. Every policy runs at one instance and
    at the largest fleet with round-robin; elsewhere only device-only,
    barrier and overlap (the routers beyond round-robin at the largest
    fleet: overlap alone), unless ``full``."""
    top = max(instances)
    out = []
    for n in sorted(instances):
        names = ["round-robin"] if n == 1 else routers_big if n == top else routers_small
        for r in names:
            if full or n == 1 or (n == top and r == "round-robin"):
                pols = ALL
            else:
                pols = "overlap" if n == top else CUT
            out.append((n, r, pols))
    return out


def _run(argv: list[str]) -> dict[str, Any]:
    args = replay.build_parser().parse_args(argv)
    out = asyncio.run(replay.run_replay(args))
    out["meta"] = {"command": "layerlift bench replay " + " ".join(argv)}
    return out


def render(record: dict[str, Any]) -> str:
    """The grid as Markdown: one table per setting."""
    lines = ["# Fleet grid (simulated)", "",
             f"`{record['meta']['command']}`", "",
             "Every row is simulated: the real engine, server, tree, pools, store and "
             "emulated link, with the simulated model's compute time (see "
             "`engine/model/simulated.py`). Token counts are simulated tokens (one stands "
             "for `token scale` real ones); prefill tokens/s are real tokens.", ""]
    for name, rows in record["settings"].items():
        first = rows[0]
        st = first["setting"]
        lines += [f"## {name}: {st['profile']}, links {', '.join(st['links'])}, token scale "
                  f"{st['token_scale']}, SLO {first['fleet']['slo_ms']:g} ms", "",
                  f"![{name}]({name}.png)", "",
                  "| inst | router | policy | p50 ms | p90 ms | p99 ms | in SLO | device hit | "
                  "restored | computed | restored % | prefill tok/s (real) | loop lag p99 ms | KL |",
                  "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
        for cell in rows:
            n, router = cell["fleet"]["instances"], cell["fleet"]["router"]
            for pol, p in cell["policies"].items():
                t = p["tokens"]
                total = sum(t.values())
                d = cell["details"][pol]
                lines.append(
                    f"| {n} | {router} | {pol} | {p['ttft_p50_s'] * 1e3:.1f} | "
                    f"{p['ttft_p90_s'] * 1e3:.1f} | {p['ttft_p99_s'] * 1e3:.1f} | "
                    f"{p['within_slo_fraction']:.2f} | {t['device_hit']} | {t['restored']} | "
                    f"{t['computed']} | {100 * t['restored'] / total:.1f} | "
                    f"{p['prompt_tokens_per_s'] * st['token_scale']:.0f} | "
                    f"{d['loop_lag']['arrival_p99_s'] * 1e3:.1f} | {d['max_kl']:.0e} |")
        lines.append("")
    lines += render_targets(targets(record))
    return "\n".join(lines) + "\n"


def _p90(cell: dict[str, Any], policy: str) -> float | None:
    p = cell["policies"].get(policy)
    return None if p is None else float(p["ttft_p90_s"])


def _ratio(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None or b <= 0 else a / b


def targets(record: dict[str, Any]) -> list[dict[str, Any]]:
    """The issue's targets, checked per setting and grid point: each entry
    names the target, where, the measured value and whether it was met."""
    out: list[dict[str, Any]] = []

    def add(target: str, where: str, value: float | None, bound: float, le: bool) -> None:
        if value is None:
            return
        met = value <= bound if le else value >= bound
        out.append({"target": target, "where": where, "value": value, "bound": bound,
                    "met": met})

    for name, rows in record["settings"].items():
        top = max(c["fleet"]["instances"] for c in rows)
        by = {(c["fleet"]["instances"], c["fleet"]["router"]): c for c in rows}
        rr = by.get((top, "round-robin"))
        if rr is not None and "overlap" in rr["policies"]:
            t = rr["policies"]["overlap"]["tokens"]
            add("restored >= 25 % of prompt tokens (largest fleet, round-robin, overlap)",
                name, t["restored"] / sum(t.values()), 0.25, le=False)
        for (n, router), cell in by.items():
            where = f"{name} {n}x {router}"
            if name == "gpu-tcp25":
                add("overlap p90 <= 0.9 x barrier p90", where,
                    _ratio(_p90(cell, "overlap"), _p90(cell, "barrier")), 0.9, le=True)
            add("overlap+prefetch p90 <= overlap p90", where,
                _ratio(_p90(cell, "overlap+prefetch"), _p90(cell, "overlap")), 1.0, le=True)
            best = [x for x in (_p90(cell, "overlap"), _p90(cell, "device-only")) if x]
            add("overlap+auto p90 <= 1.05 x min(overlap, device-only) p90", where,
                _ratio(_p90(cell, "overlap+auto"), min(best) if best else None), 1.05, le=True)
        ra = by.get((top, "restore-aware"))
        if ra is not None:
            for pol in ra["policies"]:
                pre, rrc = by.get((top, "prefix")), by.get((top, "round-robin"))
                where = f"{name} {top}x {pol}"
                if pre is not None:
                    add("restore-aware p90 <= prefix p90", where,
                        _ratio(_p90(ra, pol), _p90(pre, pol)), 1.0, le=True)
                if rrc is not None:
                    add("restore-aware p90 <= 0.8 x round-robin p90", where,
                        _ratio(_p90(ra, pol), _p90(rrc, pol)), 0.8, le=True)
    return out


def render_targets(checks: Sequence[dict[str, Any]]) -> list[str]:
    lines = ["## Targets", "", "| target | where | measured | bound | met |",
             "|---|---|---|---|---|"]
    for c in checks:
        lines.append(f"| {c['target']} | {c['where']} | {c['value']:.2f} | {c['bound']:g} | "
                     f"{'yes' if c['met'] else '**no**'} |")
    met = sum(c["met"] for c in checks)
    lines += ["", f"{met} of {len(checks)} checks met.", ""]
    return lines


def plot(record: dict[str, Any], folder: Path, prefix: str = "") -> None:
    """One TTFT CDF per setting (``folder/{prefix}{setting}.png``): every
    policy at the largest fleet with the restore-aware router, and at one
    instance (dashed)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    for name, rows in record["settings"].items():
        fig, ax = plt.subplots(figsize=(7.5, 4.8))
        top = max(c["fleet"]["instances"] for c in rows)
        picks = [c for c in rows if c["fleet"]["instances"] == 1][:1] + [
            c for c in rows if c["fleet"]["instances"] == top
            and c["fleet"]["router"] in ("round-robin", "restore-aware")]
        for cell in picks:
            style = "--" if cell["fleet"]["instances"] == 1 else (
                ":" if cell["fleet"]["router"] == "round-robin" else "-")
            for pol, xs in cell["ttft_s"].items():
                ys = np.sort(np.asarray(xs)) * 1e3
                ax.plot(ys, np.arange(1, len(ys) + 1) / len(ys), style,
                        label=f"{cell['fleet']['instances']}x {cell['fleet']['router']}: {pol}")
        ax.set_xscale("log")
        ax.set_xlabel("TTFT (ms, log)")
        ax.set_ylabel("fraction of requests")
        ax.set_title(f"TTFT CDF, {name} (simulated)")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=6, ncol=2)
        fig.tight_layout()
        fig.savefig(folder / f"{prefix}{name}.png", dpi=110)
        plt.close(fig)


def render_fidelity(real: dict[str, Any], sim: dict[str, Any]) -> str:
    """Real mode against simulated (``cpu-measured``), per policy: TTFT
    p50/p90 and token counts side by side with the relative differences
    (targets: TTFT within 15 %, tokens within 2 % of the prompt tokens)."""
    lines = ["# Fidelity: real mode against the simulated model (cpu-measured)", "",
             f"real: `{real['meta']['command']}`", "",
             f"simulated: `{sim['meta']['command']}`", "",
             "| policy | p50 real ms | p50 sim ms | diff | p90 real ms | p90 sim ms | diff | "
             "hit real | hit sim | restored real | restored sim | computed real | "
             "computed sim | max token diff / prompt |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for pol, r in real["policies"].items():
        s_ = sim["policies"].get(pol)
        if s_ is None:
            continue
        tr_, ts_ = r["tokens"], s_["tokens"]
        total = sum(tr_.values())
        tok = max(abs(tr_[k] - ts_[k]) for k in tr_) / total
        d50 = s_["ttft_p50_s"] / r["ttft_p50_s"] - 1
        d90 = s_["ttft_p90_s"] / r["ttft_p90_s"] - 1
        lines.append(
            f"| {pol} | {r['ttft_p50_s'] * 1e3:.1f} | {s_['ttft_p50_s'] * 1e3:.1f} | "
            f"{100 * d50:+.0f} % | {r['ttft_p90_s'] * 1e3:.1f} | {s_['ttft_p90_s'] * 1e3:.1f} | "
            f"{100 * d90:+.0f} % | {tr_['device_hit']} | {ts_['device_hit']} | "
            f"{tr_['restored']} | {ts_['restored']} | {tr_['computed']} | {ts_['computed']} | "
            f"{100 * tok:.2f} % |")
    return "\n".join(lines) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="layerlift bench fleet-grid",
                                 description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="bench/results/fleet/grid",
                    help="folder: grid.json, grid.md, one PNG per setting (unless --json, "
                         "--markdown or --plot name other places)")
    add_output_options(ap)
    ap.add_argument("--settings", default=",".join(SETTINGS))
    ap.add_argument("--instances", default="1,2,4,8")
    ap.add_argument("--full", action="store_true",
                    help="every policy in every cell (the default cuts, see cells())")
    ap.add_argument("--routers-small", default="round-robin",
                    help="routers below the largest fleet")
    ap.add_argument("--routers-big", default="round-robin,least-loaded,prefix,restore-aware",
                    help="routers at the largest fleet")
    ap.add_argument("--requests", type=int, default=60)
    ap.add_argument("--kl-samples", type=int, default=4)
    ap.add_argument("--fidelity", nargs=2, metavar=("REAL_JSON", "SIM_JSON"), default=None,
                    help="write fidelity.md next to these two replay records instead")
    args = ap.parse_args(argv)
    if args.fidelity:
        real, sim = (json.loads(Path(p).read_text()) for p in args.fidelity)
        out = Path(args.fidelity[0]).parent / "fidelity.md"
        out.write_text(render_fidelity(real, sim))
        print(f"wrote {out}")
        return 0
    settings = [s for s in args.settings.split(",") if s]
    bad = [s for s in settings if s not in SETTINGS]
    if bad:
        raise SystemExit(f"error: unknown settings {bad}; choose from {list(SETTINGS)}")
    grid = cells([int(x) for x in args.instances.split(",")], args.routers_small.split(","),
                 args.routers_big.split(","), full=args.full)
    folder = Path(args.out)
    folder.mkdir(parents=True, exist_ok=True)
    json_path = Path(args.json or folder / "grid.json")
    md_path = Path(args.markdown or folder / "grid.md")
    for path in (json_path, md_path):
        path.parent.mkdir(parents=True, exist_ok=True)
    record: dict[str, Any] = {"benchmark": "fleet-grid", "settings": {}}
    t0 = time.perf_counter()
    for name in settings:
        rows = []
        for n, router, pols in grid:
            argv_cell = [*SETTINGS[name], "--requests", str(args.requests), "--instances",
                         str(n), "--router", router, "--policies", pols,
                         "--kl-samples", str(args.kl_samples), "--quiet"]
            t = time.perf_counter()
            rows.append(_run(argv_cell))
            print(f"{name} {n}x {router}: {time.perf_counter() - t:.0f} s", file=sys.stderr,
                  flush=True)
        record["settings"][name] = rows
        record["meta"] = {"command": command_line("fleet-grid", argv),
                          "wall_s": time.perf_counter() - t0}
        json_path.write_text(json.dumps(record, indent=1) + "\n")
        md_path.write_text(render(record))
    if args.plot:  # one PNG per setting: PLOT's name with the setting's appended
        plot_path = Path(args.plot)
        plot_path.parent.mkdir(parents=True, exist_ok=True)
        plot(record, plot_path.parent, f"{plot_path.stem}-")
    else:
        plot(record, folder)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
