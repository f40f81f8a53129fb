"""The ``layerlift`` console script.

    layerlift master [--rpc-port P ...]     run a mooncake_master in the foreground
    layerlift store-node --master H:P ...   a Mooncake client contributing a segment
    layerlift bench ttft [options]          TTFT: recompute vs barrier vs overlap restore
    layerlift bench replay [options]        the conversation trace through the serving loop
"""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence

USAGE = """usage: layerlift <command> [options]

commands:
  master        run a private mooncake_master on loopback until Ctrl-C
                (layerlift master --help)
  store-node    contribute a memory segment to a Mooncake cluster until SIGTERM
                (layerlift store-node --help)
  bench ttft    time to first token: recompute vs barrier vs overlap restore
                (layerlift bench ttft --help)
  bench replay  the Mooncake conversation trace through the serving loop, per policy
                (layerlift bench replay --help)
"""


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
        if len(args) >= 2 and args[1] == "ttft":
            from layerlift.bench.ttft import main as ttft_main

            return ttft_main(args[2:])
        if len(args) >= 2 and args[1] == "replay":
            from layerlift.bench.replay import main as replay_main

            return replay_main(args[2:])
        print("usage: layerlift bench ttft|replay [options]", file=sys.stderr)
        return 0 if len(args) >= 2 and args[1] in ("-h", "--help") else 2
    print(f"layerlift: unknown command {args[0]!r}\n\n{USAGE}", file=sys.stderr, end="")
    return 2


if __name__ == "__main__":
    sys.exit(main())
