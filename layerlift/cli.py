"""The ``layerlift`` console script, at the top of the layers (it may import
``layerlift.bench``; the engine never does).

    layerlift master [--rpc-port P ...]     run a mooncake_master in the foreground
    layerlift store-node --master H:P ...   a Mooncake client contributing a segment
    layerlift bench NAME [options]          one benchmark (``layerlift bench --help``)
    layerlift bench report                  regenerate docs/results.md from the JSON
"""

from __future__ import annotations

import importlib
import os
import sys
from collections.abc import Callable, Sequence
from typing import cast

from layerlift.bench import BENCHMARKS

__all__ = ["main"]


def _bench_usage() -> str:
    width = max(len(n) for n in BENCHMARKS)
    lines = [f"  bench {name:<{width}}  {help_}" for name, (_, help_) in BENCHMARKS.items()]
    return "\n".join(lines)


USAGE = f"""usage: layerlift <command> [options]

commands:
  master        run a private mooncake_master on loopback until Ctrl-C
                (layerlift master --help)
  store-node    contribute a memory segment to a Mooncake cluster until SIGTERM
                (layerlift store-node --help)
{_bench_usage()}

Every benchmark takes --json PATH, --markdown PATH and --plot PATH
(layerlift bench NAME --help lists the rest).
"""


def _bench(args: list[str]) -> int:
    if not args or args[0] in ("-h", "--help"):
        print(f"usage: layerlift bench NAME [options]\n\n{_bench_usage()}",
              file=sys.stdout if args else sys.stderr)
        return 0 if args else 2
    if args[0] not in BENCHMARKS:
        print(f"layerlift bench: unknown benchmark {args[0]!r}; choose from "
              f"{', '.join(BENCHMARKS)}", file=sys.stderr)
        return 2
    module = importlib.import_module(BENCHMARKS[args[0]][0])
    run = cast(Callable[[Sequence[str]], int], module.main)
    return run(args[1:])


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point; returns the exit status."""
    # Quiet Mooncake's glog output; must happen before mooncake is imported.
    # Mooncake 0.3.13 sets glog's level from MC_LOG_LEVEL (TRACE/INFO/WARNING/ERROR,
    # default INFO) and so overrides GLOG_minloglevel: set both.
    os.environ.setdefault("GLOG_minloglevel", "2")
    os.environ.setdefault("MC_LOG_LEVEL", "ERROR")
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] in ("-h", "--help", "help"):
        print(USAGE, end="")
        return 0 if args else 2
    if args[0] == "master":
        from layerlift.linker.master import main as master_main

        return master_main(args[1:])
    if args[0] == "store-node":
        from layerlift.linker.store_node import main as store_node_main

        return store_node_main(args[1:])
    if args[0] == "bench":
        return _bench(args[1:])
    print(f"layerlift: unknown command {args[0]!r}\n\n{USAGE}", file=sys.stderr, end="")
    return 2


if __name__ == "__main__":
    sys.exit(main())
