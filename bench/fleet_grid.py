"""The fleet grid: the conversation trace through 1-8 simulated instances
per router and policy, repeated over seeds; one JSON record, a Markdown page
(``bench/fleet_report.py``: every figure with its interval, the noise floor)
and one TTFT CDF per setting.

    layerlift bench fleet-grid --out bench/results/fleet/grid

Each cell is one ``layerlift bench replay`` run per seed (its command line
is in the record); a cell runs every policy on the same sampled requests,
and each seed samples its own. Settings:

* ``gpu-rdma``: Nemotron-H-8B on one H100, one 400 Gbps RDMA NIC (45 GB/s),
  token scale 64 (28 cache layers: on two shared cores the host keeps up
  with it at 200x the trace's clock; Qwen3-Next's 48 layers it did not at
  400x);
* ``gpu-tcp25``: the same with 25 Gbit TCP NICs;
* ``cpu-measured``: the reference model's layout (preset ``tiny``) with the
  compute profile fitted on this machine, the replay's default emulated link
  (not run by default: its check against real mode is the fidelity page).

What runs by default (2 shared cores, so the grid is cut to fit about half
an hour; ``--full`` runs every policy everywhere): gpu-rdma and gpu-tcp25 at
1, 4 and 8 instances, seeds 0-2, 60 requests a seed; every policy at one
instance and at the largest fleet with round-robin; device-only, barrier
and overlap elsewhere; at the largest fleet the other routers with overlap.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from layerlift.bench import replay
from layerlift.bench.fleet_report import grouped, render, render_targets, targets
from layerlift.bench.output import add_output_options, command_line

__all__ = ["SETTINGS", "cells", "main", "plot", "render", "render_fidelity", "render_targets",
           "targets"]

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


def plot(record: dict[str, Any], folder: Path, prefix: str = "") -> None:
    """One TTFT CDF per setting (``folder/{prefix}{setting}.png``), every seed
    pooled: every policy at one instance (dashed) and at the largest fleet
    with round-robin (dotted) and restore-aware (solid)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    for name, rows in record["settings"].items():
        fig, ax = plt.subplots(figsize=(8, 5))
        by = grouped(rows)
        top = max(n for n, _ in by)
        picks = [k for k in by if k[0] == 1][:1] + [
            k for k in by if k[0] == top and k[1] in ("round-robin", "restore-aware")]
        for key in picks:
            style = "--" if key[0] == 1 else (":" if key[1] == "round-robin" else "-")
            for pol in by[key][0]["ttft_s"]:
                ys = np.sort(np.concatenate([r["ttft_s"][pol] for r in by[key]])) * 1e3
                ax.plot(ys, np.arange(1, len(ys) + 1) / len(ys), style,
                        label=f"{key[0]}x {key[1]}: {pol}")
        ax.set_xscale("log")
        ax.set_xlabel("time to first token (ms, log scale)", fontsize=11)
        ax.set_ylabel("fraction of requests", fontsize=11)
        seeds = len({r["scaling"]["seed"] for r in rows})
        ax.set_title(f"TTFT CDF, {name} (simulated, {seeds} seeds pooled)", fontsize=12)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8, ncol=2)
        fig.tight_layout()
        fig.savefig(folder / f"{prefix}{name}.png", dpi=110)
        plt.close(fig)


def render_fidelity(real: dict[str, Any], sim: dict[str, Any]) -> str:
    """Real mode against simulated (``cpu-measured``), per policy: TTFT
    p50/p90 and token counts side by side with the relative differences
    (targets: TTFT within 15 %, tokens within 2 % of the prompt tokens),
    then the whole spread of the differences and the check's scope."""
    lines = ["# Fidelity: real mode against the simulated model (cpu-measured)", "",
             f"real: `{real['meta']['command']}`", "",
             f"simulated: `{sim['meta']['command']}`", "",
             "| policy | p50 real ms | p50 sim ms | diff | p90 real ms | p90 sim ms | diff | "
             "hit real | hit sim | restored real | restored sim | computed real | "
             "computed sim | max token diff / prompt |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    diffs: dict[int, list[float]] = {50: [], 90: []}
    for pol, r in real["policies"].items():
        s_ = sim["policies"].get(pol)
        if s_ is None:
            continue
        tr_, ts_ = r["tokens"], s_["tokens"]
        total = sum(tr_.values())
        tok = max(abs(tr_[k] - ts_[k]) for k in tr_) / total
        d50 = s_["ttft_p50_s"] / r["ttft_p50_s"] - 1
        d90 = s_["ttft_p90_s"] / r["ttft_p90_s"] - 1
        diffs[50].append(d50)
        diffs[90].append(d90)
        lines.append(
            f"| {pol} | {r['ttft_p50_s'] * 1e3:.1f} | {s_['ttft_p50_s'] * 1e3:.1f} | "
            f"{100 * d50:+.0f} % | {r['ttft_p90_s'] * 1e3:.1f} | {s_['ttft_p90_s'] * 1e3:.1f} | "
            f"{100 * d90:+.0f} % | {tr_['device_hit']} | {ts_['device_hit']} | "
            f"{tr_['restored']} | {ts_['restored']} | {tr_['computed']} | {ts_['computed']} | "
            f"{100 * tok:.2f} % |")
    lines.append("")
    for q, ds in diffs.items():
        if ds:
            within = sum(abs(d) <= 0.15 for d in ds)
            lines.append(f"- p{q}: simulated minus real from {100 * min(ds):+.0f} % to "
                         f"{100 * max(ds):+.0f} % (median {100 * float(np.median(ds)):+.0f} %) "
                         f"over the {len(ds)} policies; within 15 %: {within} of {len(ds)}.")
    st = sim.get("setting", {})
    lines += ["", f"Scope: one run each (seed {sim['scaling']['seed']}), one instance, token "
              f"scale {st.get('token_scale', 1)}, the `{st.get('profile', 'cpu-measured')}` "
              "profile (the reference model's own per-layer times on this CPU, fitted by "
              "`bench/calibrate.py`) against the reference model itself. It checks that the "
              "simulated model reproduces the engine's behaviour where both can run; it says "
              "nothing about the GPU settings' roofline (`docs/roofline.md`), their token scale "
              "or a fleet.", ""]
    return "\n".join(lines)


def _load() -> list[float]:
    try:
        return [float(x) for x in os.getloadavg()]
    except OSError:  # not available on this platform
        return [float("nan")] * 3


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="layerlift bench fleet-grid",
                                 description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="bench/results/fleet/grid",
                    help="folder: grid.json, grid.md, one PNG per setting (unless --json, "
                         "--markdown or --plot name other places)")
    add_output_options(ap)
    ap.add_argument("--settings", default="gpu-rdma,gpu-tcp25",
                    help=f"comma separated, from {','.join(SETTINGS)}")
    ap.add_argument("--instances", default="1,4,8", help="fleet sizes, comma separated")
    ap.add_argument("--seeds", default="0,1,2",
                    help="one repeat per seed (each samples its own requests); at least 3 for "
                         "the intervals to mean something")
    ap.add_argument("--full", action="store_true",
                    help="every policy in every cell (the default cuts, see cells())")
    ap.add_argument("--routers-small", default="round-robin",
                    help="routers below the largest fleet")
    ap.add_argument("--routers-big", default="round-robin,least-loaded,prefix,restore-aware",
                    help="routers at the largest fleet")
    ap.add_argument("--requests", type=int, default=60, help="about this many requests a seed")
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
        print(f"layerlift bench fleet-grid: error: unknown settings {bad}; choose from "
              f"{list(SETTINGS)}", file=sys.stderr)
        return 2
    seeds = [int(x) for x in args.seeds.split(",") if x]
    grid = cells([int(x) for x in args.instances.split(",")], args.routers_small.split(","),
                 args.routers_big.split(","), full=args.full)
    folder = Path(args.out)
    folder.mkdir(parents=True, exist_ok=True)
    json_path = Path(args.json or folder / "grid.json")
    md_path = Path(args.markdown or folder / "grid.md")
    for path in (json_path, md_path):
        path.parent.mkdir(parents=True, exist_ok=True)
    record: dict[str, Any] = {"benchmark": "fleet-grid", "settings": {}}
    t0, load0 = time.perf_counter(), _load()
    todo = len(settings) * len(grid) * len(seeds)
    done = 0
    for name in settings:
        rows = []
        for seed in seeds:
            for n, router, pols in grid:
                argv_cell = [*SETTINGS[name], "--requests", str(args.requests), "--instances",
                             str(n), "--router", router, "--policies", pols, "--seed",
                             str(seed), "--kl-samples", str(args.kl_samples), "--quiet"]
                t = time.perf_counter()
                done += 1
                try:
                    rows.append(_run(argv_cell))
                except replay.NothingToRestore as exc:  # the cell compares nothing: left out
                    print(f"[{done}/{todo}] {name} seed {seed} {n}x {router}: left out: {exc}",
                          file=sys.stderr, flush=True)
                    continue
                print(f"[{done}/{todo}] {name} seed {seed} {n}x {router} ({pols}): "
                      f"{time.perf_counter() - t:.0f} s", file=sys.stderr, flush=True)
        record["settings"][name] = rows
        record["meta"] = {"command": command_line("fleet-grid", argv), "seeds": seeds,
                          "wall_s": time.perf_counter() - t0, "cpus": os.cpu_count(),
                          "load_average": {"start": load0, "end": _load()}}
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
