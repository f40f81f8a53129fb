"""Summarise an ``ab_fleet.sh`` folder: per run (in the order run) each
policy's TTFT p50/p90, queue p90, tokens restored, the process's CPU
seconds and the load average before it; then each side's medians."""

from __future__ import annotations

import json
import re
import statistics
import sys
from pathlib import Path


def main() -> None:
    out = Path(sys.argv[1])
    loads: dict[str, str] = {}
    order: list[str] = []
    for line in (out / "log").read_text().splitlines():
        m = re.match(r"(\S+) start \S+ load (.*)", line)
        if m:
            loads[m[1]] = m[2]
            order.append(m[1])
    rows: dict[tuple[str, str], list[tuple[float, float, float]]] = {}
    print("| run | policy | TTFT p50 ms | p90 ms | queue p90 ms | restored tok | cpu s | "
          "load avg (1/5/15 min) before |")
    print("|---|---|---|---|---|---|---|---|")
    for run in order:
        js, txt = out / f"{run}.json", out / f"{run}.txt"
        if not js.exists():
            print(f"| {run} | (failed: see {txt}) | | | | | | {loads[run]} |")
            continue
        cpu = re.search(r"ab_run: cpu ([\d.]+) s", txt.read_text())
        for policy, p in json.loads(js.read_text())["policies"].items():
            side = run.split("_")[0]
            rows.setdefault((side, policy), []).append(
                (p["ttft_p50_s"] * 1e3, p["ttft_p90_s"] * 1e3, float(cpu[1]) if cpu else 0.0))
            print(f"| {run} | {policy} | {p['ttft_p50_s'] * 1e3:.0f} | "
                  f"{p['ttft_p90_s'] * 1e3:.0f} | {p['queue_p90_s'] * 1e3:.0f} | "
                  f"{p['tokens']['restored']} | {cpu[1] if cpu else '?'} | {loads[run]} |")
    print()
    print("| side | policy | runs | median p50 ms | median p90 ms | median cpu s |")
    print("|---|---|---|---|---|---|")
    for (side, policy), got in sorted(rows.items()):
        print(f"| {side} | {policy} | {len(got)} | {statistics.median(g[0] for g in got):.0f} | "
              f"{statistics.median(g[1] for g in got):.0f} | "
              f"{statistics.median(g[2] for g in got):.1f} |")


if __name__ == "__main__":
    main()
