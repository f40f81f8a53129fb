"""What the host transfer benchmarks (``bench transfer-sglang``, ``bench
transfer-vllm``) share beside ``bench transfer``'s :class:`Bench`: their
rounds (:class:`Rounds`, a unit :class:`NotMeasured`), their case options
and their run over every link (:func:`run_host_bench`)."""

from __future__ import annotations

import argparse
import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from layerlift.bench.args import int_at_least, int_list
from layerlift.bench.netns_link import per_link
from layerlift.bench.output import write_outputs
from layerlift.bench.results import plot, render
from layerlift.bench.stats import spread
from layerlift.bench.thread_cpu import GROUPS
from layerlift.bench.transfer import Step

__all__ = ["NotMeasured", "Rounds", "add_case_options", "run_host_bench"]


class NotMeasured(RuntimeError):
    """A unit of a host transfer benchmark could not do its job this time (a
    host's offloads that never end, a host's save that stored less than it
    was given): its rows of the case are ``not measured``, with the reason."""


class Rounds:
    """The host transfer benchmarks' rounds: round -1 warms up (checked,
    not timed), then ``repeats`` rounds of ``units`` (each returns its rows'
    :class:`Step`) in an order rotated per round. A unit that raises
    :class:`NotMeasured` leaves the case (``failed``: unit -> why), in every
    round, so ratios stay paired over the same rounds."""

    def __init__(self, units: dict[str, Callable[[], dict[str, Step]]], repeats: int) -> None:
        order = list(units)
        self.runs: list[dict[str, Step]] = []
        self.failed: dict[str, str] = {}
        for rep in range(-1, repeats):
            got: dict[str, Step] = {}
            for unit in order[rep % len(order):] + order[: rep % len(order)]:
                if unit in self.failed:
                    continue
                try:
                    got.update(units[unit]())
                except NotMeasured as exc:
                    print(f"    {exc}: not measured", flush=True)
                    self.failed[unit] = str(exc)
            if rep >= 0:
                self.runs.append(got)

    def of(self, row: str) -> list[float]:
        """Row ``row``'s GB/s, per round."""
        return [r[row].gbps for r in self.runs]

    def ratio(self, a: str, b: str) -> dict[str, float]:
        """The spread of row ``a``'s GB/s over row ``b``'s, per round."""
        return spread([x / y for x, y in zip(self.of(a), self.of(b), strict=True)])

    def spreads(self, kind: str, rows: dict[str, str],
                base: str) -> dict[str, dict[str, Any]]:
        """The record's entries of ``kind`` (``loads``, ``offloads``) for
        ``rows`` (label -> row): GB/s, ``/ raw`` (the ratio to row ``base``,
        per round), cores, machine cores and the process's cores by kind of
        thread (``{label: {group: spread}}``), each ``{label: spread}``; a
        row's machine and thread figures only where every round read them
        (never made up from some rounds)."""
        machine = {label: [r[row].machine for r in self.runs] for label, row in rows.items()}
        threads = {label: [r[row].threads for r in self.runs] for label, row in rows.items()}
        return {
            kind: {label: spread(self.of(row)) for label, row in rows.items()},
            f"{kind} / raw": {label: self.ratio(row, base) for label, row in rows.items()},
            f"{kind} cores": {label: spread([r[row].cores for r in self.runs])
                              for label, row in rows.items()},
            f"{kind} machine cores": {label: spread([x for x in v if x is not None])
                                      for label, v in machine.items() if v and None not in v},
            f"{kind} threads": {label: {g: spread([t[g] for t in v if t is not None])
                                        for g in GROUPS}
                                for label, v in threads.items() if v and None not in v},
        }


def add_case_options(parser: argparse.ArgumentParser, *, sizes: str, default: list[int],
                     sizes_help: str) -> None:
    """The host transfer benchmarks' case options: ``--tokens``, ``sizes``
    (``--page-sizes``, ``--block-sizes``) with its ``default``,
    ``--repeats``, ``--timeout``."""
    parser.add_argument("--tokens", type=int_list(256, "8192"), default=[8192],
                        help="prompt lengths in tokens, comma-separated")
    parser.add_argument(sizes, type=int_list(16, ",".join(map(str, default))), default=default,
                        help=sizes_help)
    parser.add_argument("--repeats", type=int_at_least(1), default=5, help="rounds per case")
    parser.add_argument("--timeout", type=float, default=60.0,
                        help="the stores' timeout per call and the restores' bound (s)")


def run_host_bench(name: str, args: argparse.Namespace, argv: list[str] | None, *,
                   loopback: Callable[[], Any], cluster: Callable[[str], Any],
                   netns: Callable[[str], Any], layout: str, timing: str) -> int:
    """A host transfer benchmark's run: on a namespace link's engine host
    (``--cluster``) ``cluster(master)``'s cases to ``--json``; else every
    link (:func:`per_link`), the record and its table."""
    os.environ.setdefault("MC_LOG_LEVEL", "ERROR")
    if args.cluster:
        cases = cluster(args.cluster)
        if args.json is not None:
            Path(args.json).write_text(json.dumps({"cases": cases}))
        return 0
    links = per_link(None if args.no_loopback else loopback, args.netns, netns)
    report: dict[str, Any] = {
        "links": links, "layout": layout, "timing": timing,
        "meta": {"loadavg": [round(x, 2) for x in os.getloadavg()], "cpus": os.cpu_count()},
    }
    record = write_outputs(name, report, args, argv, render, plot)
    print(render(record))
    return 0
