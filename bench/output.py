"""The output options every ``layerlift bench NAME`` shares, and how they are written.

Every benchmark takes ``--json PATH``, ``--markdown PATH`` and ``--plot PATH``.
The JSON is the record (it carries ``benchmark``: the benchmark's name, and
``meta.command``: the command line that made it); the Markdown and the plot are
drawn from that record by :mod:`layerlift.bench.results`, the same functions
``layerlift bench report`` uses for ``docs/results.md``, so a table written
by a run and the table in the docs cannot differ. (``ttft`` and ``replay``
write their own fuller Markdown report with the same three options; the
results page draws their tables from the JSON too.)
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

__all__ = ["add_output_options", "command_line", "write_outputs"]


def add_output_options(ap: argparse.ArgumentParser) -> None:
    """Add ``--json``, ``--markdown`` and ``--plot`` (each a path, off by default)."""
    ap.add_argument("--json", default=None, metavar="PATH", help="write the results as JSON here")
    ap.add_argument("--markdown", default=None, metavar="PATH",
                    help="write the Markdown table here (the one docs/results.md shows)")
    ap.add_argument("--plot", default=None, metavar="PATH", type=_plot_path,
                    help="write a PNG plot here (needs matplotlib: the dev extra)")


def _plot_path(path: str) -> str:
    """``--plot``'s check, before a run spends its minutes: matplotlib is there
    (the hosts' environments do not have it)."""
    if importlib.util.find_spec("matplotlib") is None:
        raise argparse.ArgumentTypeError(
            "needs matplotlib, which this environment lacks (the dev extra: pip install "
            "matplotlib); or leave --plot out and draw it later with `layerlift bench "
            "report` from the main environment")
    return path


def command_line(name: str, argv: Sequence[str] | None) -> str:
    """The ``layerlift bench NAME ...`` line a run was started with."""
    args = list(sys.argv[1:] if argv is None else argv)
    return " ".join(["layerlift", "bench", name, *args])


def write_outputs(name: str, data: dict[str, Any], args: argparse.Namespace,
                  argv: Sequence[str] | None, render: Callable[[dict[str, Any]], str],
                  plot: Callable[[dict[str, Any], str], None]) -> dict[str, Any]:
    """Stamp ``data`` with the benchmark's name and command, then write what
    ``args`` asks for: the JSON record, ``render(record)`` as Markdown,
    ``plot(record, path)``. Returns the stamped record. (The callers pass
    :func:`layerlift.bench.results.render` and ``plot``: this module imports
    no benchmark, so every benchmark can import it.)"""
    meta = dict(data.get("meta", {}))
    meta.setdefault("command", command_line(name, argv))
    record = {"benchmark": name, **data, "meta": meta}
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(record, indent=1) + "\n")
    if args.markdown:
        Path(args.markdown).parent.mkdir(parents=True, exist_ok=True)
        Path(args.markdown).write_text(render(record) + "\n")
    if args.plot:
        plot(record, args.plot)
    return record
