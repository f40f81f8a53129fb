"""The TTFT harness's ``netns:RATE`` link: real Mooncake TCP between hosts.

The master and a storage node (``layerlift store-node``) run on their own
namespace hosts; the benchmark itself (all its engines) runs as a child
process on a third host whose link is throttled by the kernel's token bucket
(``tbf``, both ends) to RATE. The child runs the same grid with the internal
link ``cluster:MASTER`` (a pure client, segment 0, over P2PHANDSHAKE), so
every restored byte crosses the throttled link, and hands its points back as
JSON. Needs root; where namespaces are unavailable the caller says why and the
emulated link at the same rate stands in.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterator, Sequence
from functools import partial
from pathlib import Path
from typing import Any

from layerlift.testing.netns import NetnsHosts

__all__ = [
    "RPC_PORT", "add_link_options", "emulated_twin", "engine_host_json", "is_netns", "netns_cluster", "per_link",
    "rate_gbps", "run_in_engine_host",
    "run_netns_link",
]  # fmt: skip

RPC_PORT = 50051
_RATE = re.compile(r"^netns:(?P<num>\d+(?:\.\d+)?)(?P<unit>kbit|mbit|gbit)$")
_UNIT_GBPS = {"kbit": 1e-6 / 8, "mbit": 1e-3 / 8, "gbit": 1 / 8}


def is_netns(link: str) -> bool:
    return link.startswith("netns:")


def rate_gbps(link: str) -> float:
    """GB/s of ``netns:RATE`` (``netns:1gbit`` -> 0.125). Raises ValueError otherwise."""
    match = _RATE.match(link.strip().lower())
    if match is None:
        raise ValueError(f"bad link {link!r}: use netns:RATE with RATE like 1gbit or 500mbit")
    return float(match["num"]) * _UNIT_GBPS[match["unit"]]


def rate_arg(text: str) -> str:
    """An argparse type: a bare RATE (``1gbit``, ``10gbit``, ``500mbit``), as given."""
    try:
        rate_gbps(f"netns:{text}")
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected a rate like 1gbit, 10gbit or 500mbit, got {text!r}") from None
    return text


def emulated_twin(link: str) -> str:
    """The emulated link at the same rate as ``netns:RATE`` (10 us per fetch)."""
    return f"emulated:{rate_gbps(link):g},10"


def _child_argv(args: argparse.Namespace, master: str, out: Path) -> list[str]:
    def join(values: list[Any]) -> str:
        return ",".join(str(v) for v in values)

    argv = [
        sys.executable, "-m", "layerlift.cli", "bench", "ttft",
        "--model", join(args.preset), "--prefix", join(args.prefix),
        "--suffix", join(args.suffix), "--batch", join(args.batch),
        "--repeats", str(args.repeats), "--warmup", str(args.warmup),
        "--device", args.device, "--seed", str(args.seed),
        "--links", f"cluster:{master}", "--json", str(out),
    ]  # fmt: skip
    if args.threads:
        argv += ["--threads", str(args.threads)]
    if args.no_progress:
        argv.append("--no-progress")
    return argv


def _expect(proc: subprocess.Popen[bytes], prefix: bytes, what: str) -> None:
    assert proc.stdout is not None
    line = proc.stdout.readline()
    if not line.startswith(prefix):
        raise RuntimeError(f"the {what} did not start (printed {line!r})")


@contextlib.contextmanager
def netns_cluster(rate: str, segment_bytes: int, workdir: str) -> Iterator[tuple[NetnsHosts, str]]:
    """Hosts ``master``, ``store`` and ``engine`` (its link throttled to `rate`), with a
    master and a storage node of `segment_bytes` running; yields the hosts and the
    master's address. Their stderr goes to `workdir`/servers.log."""
    env = {**os.environ, "MC_LOG_LEVEL": "ERROR", "GLOG_minloglevel": "2"}
    cli = [sys.executable, "-m", "layerlift.cli"]
    with NetnsHosts(["master", "store", "engine"], rates={"engine": rate}) as hosts:
        master = f"{hosts['master'].address}:{RPC_PORT}"
        with open(Path(workdir) / "servers.log", "ab") as log:  # the children keep their copy
            proc = hosts.popen(
                "master",
                [*cli, "master", "--p2p", "--host", hosts["master"].address, "--rpc-port", str(RPC_PORT)],
                env=env, stdout=subprocess.PIPE, stderr=log, cwd=workdir,
            )  # fmt: skip
            _expect(proc, b"master_address", "master")
            proc = hosts.popen(
                "store",
                [*cli, "store-node", "--master", master, "--bytes", str(segment_bytes),
                 "--host", hosts["store"].address],
                env=env, stdout=subprocess.PIPE, stderr=log, cwd=workdir,
            )  # fmt: skip
            _expect(proc, b"ready", "storage node")
        yield hosts, master


def run_in_engine_host(hosts: NetnsHosts, argv: list[str], workdir: str) -> int:
    """Run `argv` on the engine host to completion; its exit status."""
    env = {**os.environ, "MC_LOG_LEVEL": "ERROR", "GLOG_minloglevel": "2"}
    return hosts.popen("engine", argv, env=env, stdout=subprocess.DEVNULL, cwd=workdir).wait()


def add_link_options(parser: argparse.ArgumentParser) -> None:
    """The link options of a benchmark run on loopback and namespace links
    (read back by :func:`per_link`): ``--netns RATE`` (repeatable),
    ``--no-loopback``, and the hidden ``--cluster`` its child on the engine
    host takes."""
    parser.add_argument("--netns", type=rate_arg, action="append", default=[], metavar="RATE",
                        help="also over a namespace link throttled to RATE (e.g. 10gbit, "
                             "1gbit; repeatable; needs root)")
    parser.add_argument("--no-loopback", action="store_true", help="only the --netns links")
    parser.add_argument("--cluster", default=None, help=argparse.SUPPRESS)  # on the engine host


def per_link(loopback: Callable[[], Any] | None, rates: Sequence[str],
             over: Callable[[str], Any]) -> dict[str, Any]:
    """A benchmark's result per link, labelled as its record names them:
    ``mooncake-tcp-loopback`` (``loopback()``, unless None), then
    ``mooncake-tcp-netns RATE`` (``over(RATE)``) for each of ``rates``; each
    label printed as its link starts."""
    links: dict[str, Any] = {}
    runs = ([("mooncake-tcp-loopback", loopback)] if loopback is not None else []) + [
        (f"mooncake-tcp-netns {rate}", partial(over, rate)) for rate in rates]
    for label, run in runs:
        print(label, flush=True)
        links[label] = run()
    return links


def engine_host_json(hosts: NetnsHosts, argv: list[str], workdir: str, out: Path) -> Any:
    """Run `argv` (a benchmark that writes its JSON to `out`) on the engine
    host; what it wrote. RuntimeError with its exit status and the tail of the
    servers' log (`workdir`/servers.log) when it wrote nothing."""
    status = run_in_engine_host(hosts, argv, workdir)
    if not out.exists():
        log_path = Path(workdir) / "servers.log"
        log = log_path.read_text(errors="replace")[-2000:] if log_path.exists() else ""
        raise RuntimeError(f"the benchmark on the engine host exited with {status}; "
                           f"servers' log: {log}")
    return json.loads(out.read_text())


def run_netns_link(link: str, args: argparse.Namespace, segment_bytes: int) -> list[dict[str, Any]]:
    """Run the grid of `args` over ``netns:RATE``; the points, labelled with the link."""
    rate = link.removeprefix("netns:")
    rate_gbps(link)  # validates
    with (
        tempfile.TemporaryDirectory(prefix="layerlift-netns-") as tmp,
        netns_cluster(rate, segment_bytes, tmp) as (hosts, master),
    ):
        out = Path(tmp) / "points.json"
        points: list[dict[str, Any]] = engine_host_json(
            hosts, _child_argv(args, master, out), tmp, out)["points"]
    label = f"mooncake-tcp-netns {rate}"
    for p in points:
        p["link"] = label
        p["link_arg"] = link
    return points
