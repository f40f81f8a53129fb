"""The ``layerlift`` console script, at the top of the layers (it may import
``layerlift.bench``; the engine never does).

    layerlift master [--rpc-port P ...]     run a mooncake_master in the foreground
    layerlift store-node --master H:P ...   a Mooncake client contributing a segment
    layerlift bench NAME [options]          one benchmark (``layerlift bench --help``)
    layerlift bench report                  regenerate docs/results.md from the JSON
    layerlift --version                     the installed version

Errors in the options are one line on stderr with exit status 2.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import sys
from collections.abc import Callable, Sequence
from typing import cast

from layerlift.bench import BENCHMARKS
from layerlift.linker.mooncake_env import apply_defaults

__all__ = ["main"]


def _bench_usage() -> str:
    width = max(len(n) for n in BENCHMARKS)
    lines = [f"  bench {name:<{width}}  {help_}" for name, (_, help_) in BENCHMARKS.items()]
    return "\n".join(lines)


USAGE = f"""usage: layerlift <command> [options]   (layerlift --version: the version)

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
    if not args:
        print(f"layerlift bench: error: name a benchmark: {', '.join(BENCHMARKS)} "
              "(see layerlift bench --help)", file=sys.stderr)
        return 2
    if args[0] in ("-h", "--help"):
        print(f"usage: layerlift bench NAME [options]\n\n{_bench_usage()}")
        return 0
    if args[0] not in BENCHMARKS:
        print(f"layerlift bench: error: unknown benchmark {args[0]!r}; choose from "
              f"{', '.join(BENCHMARKS)}", file=sys.stderr)
        return 2
    module = importlib.import_module(BENCHMARKS[args[0]][0])
    run = cast(Callable[[Sequence[str]], int], module.main)
    return run(args[1:])  # a usage error raises SystemExit(2) (argparse's convention)


def version() -> str:
    """The installed distribution's version ("unknown" when not installed)."""
    try:
        return importlib.metadata.version("layerlift")
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point; returns the exit status (2 for a usage error)."""
    # Mooncake's quiet defaults (errors only, 2 setup tries) unless the user
    # set them; must happen before mooncake is imported (linker/mooncake_env.py).
    apply_defaults()
    args = list(sys.argv[1:] if argv is None else argv)
    if not args:
        print("layerlift: error: name a command: master, store-node or bench "
              "(see layerlift --help)", file=sys.stderr)
        return 2
    if args[0] in ("-h", "--help", "help"):
        print(USAGE, end="")
        return 0
    if args[0] in ("-V", "--version"):
        print(f"layerlift {version()}")
        return 0
    if args[0] == "master":
        from layerlift.linker.master import main as master_main

        return master_main(args[1:])
    if args[0] == "store-node":
        from layerlift.linker.store_node import main as store_node_main

        return store_node_main(args[1:])
    if args[0] == "bench":
        return _bench(args[1:])
    print(f"layerlift: error: unknown command {args[0]!r}; choose master, store-node or "
          "bench (see layerlift --help)", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
