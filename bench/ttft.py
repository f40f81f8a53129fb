"""`python bench/ttft.py [options]` = `layerlift bench ttft [options]` (see engine/bench_ttft.py)."""
import sys

from layerlift.engine.cli import main

sys.exit(main(["bench", "ttft", *sys.argv[1:]]))
