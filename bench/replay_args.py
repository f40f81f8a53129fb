"""The options of ``layerlift bench replay``: the parser, with every default
in ``--help``, and the checks that need more than one option.

A bad value is refused in one line on stderr with exit status 2: while
parsing (argparse), or by :func:`check` (ranges, a missing trace file);
:func:`fail` is the same one line for what the run itself refuses.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import NoReturn

from layerlift.bench.fleet import NETWORKS
from layerlift.bench.routers import ROUTERS
from layerlift.bench.ttft_args import links as parse_links
from layerlift.engine.model.architectures import ARCHITECTURES
from layerlift.engine.model.compute_model import DEVICES
from layerlift.pools.spec import ModelSpec

__all__ = ["DEFAULT_LINK", "POLICIES", "build_parser", "check", "fail"]

POLICIES = ("device-only", "barrier", "overlap", "overlap+prefetch", "overlap+auto")
DEFAULT_LINK = "emulated:0.1,10"
REPO = Path(__file__).resolve().parents[1]


def _csv(text: str) -> list[str]:
    return [x for x in text.replace(" ", "").split(",") if x]


def _policies(text: str) -> list[str]:
    out = _csv(text)
    bad = [p for p in out if p not in POLICIES]
    if bad or not out:
        raise argparse.ArgumentTypeError(f"unknown policies {bad}; choose from {list(POLICIES)}")
    return out


def _links(text: str) -> list[str]:
    try:
        return parse_links(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="layerlift bench replay",
        description="Replay the Mooncake conversation trace through the serving loop, per "
                    "cache policy, on one instance or a routed fleet, with the reference "
                    "model or the simulated one: TTFT, queueing, tokens by source.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--trace", default=None,
                    help="trace jsonl or jsonl.gz (default: the bundled Mooncake conversation "
                         "trace, bench/data/conversation_trace.jsonl.gz)")
    ap.add_argument("--requests", type=int, default=200, help="about this many requests")
    ap.add_argument("--sample", choices=["families", "window"], default="families")
    ap.add_argument("--start-request", type=int, default=0, help="first request (window)")
    ap.add_argument("--seed", type=int, default=0, help="sampling, token and KL-sample seed")
    ap.add_argument("--block-tokens", type=int, default=48,
                    help="tokens per trace block (the trace's are 512)")
    ap.add_argument("--time-scale", type=float, default=100.0,
                    help="replay the arrivals this many times faster")
    ap.add_argument("--pool-fraction", type=float, default=0.25,
                    help="device pool as a fraction of the replay's working set")
    ap.add_argument("--policies", type=_policies, default=list(POLICIES),
                    help=f"comma separated, from {','.join(POLICIES)}")
    ap.add_argument("--links", type=_links, default=[DEFAULT_LINK],
                    help="mooncake (embedded master on loopback) and/or emulated:GBPS[,LAT_US]")
    ap.add_argument("--branch-checkpoints", choices=["on", "off", "both"], default="on")
    ap.add_argument("--preset", default="tiny", choices=ModelSpec.preset_names())
    ap.add_argument("--batch-tokens", type=int, default=4096,
                    help="the server's max_batch_tokens")
    ap.add_argument("--kl-samples", type=int, default=8, help="requests checked against cold runs")
    ap.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    ap.add_argument("--instances", type=int, default=1,
                    help="serving instances on one shared store (a fleet)")
    ap.add_argument("--router", choices=ROUTERS, default="round-robin",
                    help="which instance serves each arrival")
    ap.add_argument("--slo-ms", type=float, default=1000.0,
                    help="TTFT SLO: the fraction of requests within it is reported")
    ap.add_argument("--model", choices=["real", "simulated"], default="real",
                    help="the reference model on this CPU, or the simulated model")
    ap.add_argument("--arch", choices=["reference", *ARCHITECTURES], default="reference",
                    help="simulated: the reference layout (cpu-measured) or a published one")
    ap.add_argument("--device", default="h100", help=f"simulated GPU: {', '.join(DEVICES)}")
    ap.add_argument("--gpus", type=int, default=0,
                    help="GPUs (and NICs) per instance; 0: the architecture's default")
    ap.add_argument("--network", choices=list(NETWORKS), default="rdma",
                    help="simulated: each GPU's NIC to the store")
    ap.add_argument("--track-blocks", type=int, default=4,
                    help="simulated architecture: trace blocks per checkpoint interval")
    ap.add_argument("--calibration", default=str(REPO / "bench" / "results" / "fleet" /
                                                   "cpu_profile.json"),
                    help="the cpu-measured profile (measured here when missing)")
    ap.add_argument("--json", default=None, help="write the results as JSON here")
    ap.add_argument("--markdown", default=None, help="write a Markdown table here")
    ap.add_argument("--plot", default=None, help="write the TTFT CDF (PNG) here")
    ap.add_argument("--host-costs", choices=["charged", "off"], default="charged",
                    help="charged: the CRC check and copies of the bytes the token scale leaves "
                         "out are charged at this machine's rates, and offload puts go through "
                         "an emulated egress NIC (bench/hostcost.py); off: neither")
    ap.add_argument("--quiet", dest="progress", action="store_false",
                    help="no progress lines on stderr")
    return ap


def fail(message: str) -> NoReturn:
    """One line on stderr and exit status 2 (bad input or a run that cannot compare)."""
    print(f"layerlift bench replay: error: {message}", file=sys.stderr)
    raise SystemExit(2)


def check(args: argparse.Namespace) -> None:
    """Refuse, in one line, what no single option's parser can see."""
    if args.requests < 1 or args.block_tokens < 1 or args.time_scale <= 0:
        fail("--requests and --block-tokens must be >= 1, --time-scale > 0")
    if args.pool_fraction <= 0:
        fail("--pool-fraction must be positive")
    if args.instances < 1 or args.gpus < 0 or args.track_blocks < 1 or args.slo_ms <= 0:
        fail("--instances and --track-blocks must be >= 1, --gpus >= 0, --slo-ms > 0")
    if args.trace is not None and not Path(args.trace).is_file():
        fail(f"--trace {args.trace}: no such file; give a trace .jsonl (or .jsonl.gz), or "
             "leave --trace out for the bundled one (bench/data/conversation_trace.jsonl.gz)")
