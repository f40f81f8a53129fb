"""Run ``layerlift`` from another checkout of the tree (a ``git worktree``)
with the main venv: ``python scripts/ab_run.py ROOT bench replay ...``.

The venv's editable finder maps ``layerlift.*`` to the main checkout; this
points its mapping at ROOT before anything of layerlift is imported, so the
same interpreter and packages run the other commit's code (no second venv).
Processes it starts do the same (``ab_site/sitecustomize.py`` on
``PYTHONPATH``, ``LAYERLIFT_AB_ROOT``): a namespace link's engine host runs
ROOT's code too, not the main checkout's.
Prints the process's CPU seconds (user + system) at exit: on a machine
whose load others share, the CPU a run needs for the same work is steadier
than its latencies."""

from __future__ import annotations

import importlib
import os
import resource
import sys
import time
from pathlib import Path


def main() -> None:
    if len(sys.argv) < 2:
        raise SystemExit("usage: ab_run.py ROOT [layerlift arguments]")
    root = Path(sys.argv[1]).resolve()
    site = Path(__file__).resolve().parent / "ab_site"
    os.environ["LAYERLIFT_AB_ROOT"] = str(root)
    os.environ["PYTHONPATH"] = os.pathsep.join(
        [str(site), *filter(None, [os.environ.get("PYTHONPATH")])])
    sys.path.insert(0, str(site))
    from ab_mapping import point_at

    if not point_at(root):
        raise SystemExit("ab_run.py: this environment has no editable install of layerlift")
    sys.argv = ["layerlift", *sys.argv[2:]]
    cli = importlib.import_module("layerlift.cli")
    where = Path(cli.__file__).resolve()
    if root not in where.parents:
        raise SystemExit(f"layerlift.cli came from {where}, not from {root}")
    wall = time.perf_counter()
    try:
        cli.main()
    finally:
        use = resource.getrusage(resource.RUSAGE_SELF)
        print(f"ab_run: cpu {use.ru_utime + use.ru_stime:.1f} s, wall "
              f"{time.perf_counter() - wall:.1f} s", file=sys.stderr)


if __name__ == "__main__":
    main()
