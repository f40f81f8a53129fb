"""`layerlift store-node`: a Mooncake client that contributes a segment and nothing else.

It lets the store's memory live on another host than the engine (and the
master on a third): engines connect with `segment_bytes=0` and read and write
the node's memory through the master. It prints one `ready ...` line on stdout
once its segment is mounted, then runs until SIGTERM or SIGINT and closes the
client (unmounting the segment) before it exits.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import threading
from collections.abc import Sequence

from layerlift.linker.master import OneLineParser
from layerlift.linker.mooncake_config import MooncakeConfig
from layerlift.linker.mooncake_store import MooncakeStore
from layerlift.linker.store_base import StoreError

__all__ = ["main"]


def _size(text: str) -> int:
    """Bytes from '512M', '4G', '1048576'."""
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    unit = units.get(text[-1:].upper(), 1)
    number = text[:-1] if unit != 1 else text
    try:
        value = int(number) * unit
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (e.g. 512M, 4G)") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"the segment must be at least 1 byte, got {text!r}")
    return value


def main(argv: Sequence[str] | None = None) -> int:
    """Run a storage node in the foreground; returns the exit status."""
    parser = OneLineParser(
        prog="layerlift store-node",
        description="Contribute a memory segment to a Mooncake cluster until SIGTERM/Ctrl-C.",
    )
    parser.add_argument("--master", required=True, help="the master's RPC address HOST:PORT")
    parser.add_argument("--metadata", default="P2PHANDSHAKE",
                        help="'P2PHANDSHAKE' or http://HOST:PORT/metadata")  # fmt: skip
    parser.add_argument("--bytes", type=_size, required=True, help="segment size (512M, 4G)")
    parser.add_argument("--host", default="127.0.0.1",
                        help="this node's address, as other clients reach it")  # fmt: skip
    parser.add_argument("--protocol", default="tcp", choices=("tcp", "rdma"))
    parser.add_argument("--rdma-devices", default="", help="e.g. mlx5_0,mlx5_1 (rdma only)")
    parser.add_argument("--setup-retries", type=int, default=None,
                        help="Mooncake's connection attempts at start, ~4.5 s each when no "
                             "master answers (MC_STORE_CLIENT_SETUP_RETRIES; Mooncake's "
                             "default is 20)")  # fmt: skip
    args = parser.parse_args(argv)
    try:
        config = MooncakeConfig(
            master_address=args.master,
            metadata_server=args.metadata,
            protocol=args.protocol,
            rdma_devices=tuple(d for d in args.rdma_devices.split(",") if d),
            local_hostname=args.host,
            global_segment_size=args.bytes,
            local_buffer_size=16 << 20,
            workers=1,
        )
    except ValueError as exc:
        parser.error(str(exc))
    if args.setup_retries is not None:  # read by Mooncake when the client starts
        os.environ["MC_STORE_CLIENT_SETUP_RETRIES"] = str(max(1, args.setup_retries))
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    try:
        store = MooncakeStore(config)
    except (StoreError, ImportError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    try:
        print(f"ready {args.host} segment={args.bytes} master={args.master}", flush=True)
        stop.wait()
    finally:
        store.close()
    return 0
