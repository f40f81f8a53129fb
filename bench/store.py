"""Per-layer ranged reads against whole-object reads from Mooncake Store.

    layerlift bench store [--json PATH] [--markdown PATH] [--plot PATH] [--repeats N] [--netns RATE]

N page objects laid out layer-major (8 layers of K+V, 8 KV heads x 128 head
dim, bf16) are read back by a client with no segment of its own, three ways:

* ``whole``: one batch ``get`` of every object (the best whole-batch restore);
* ``ranged d1``: one ``get_ranges`` per layer over all pages, one call at a
  time, inside one session: what the engine's CPU lane does (it streams a
  batch's layers through one worker, in layer order);
* ``ranged dD``: the same calls with D layers in flight (D = 4: the engine's
  ``max_in_flight`` of 8 capped by the store's 4 worker threads), as the CUDA
  lane issues them.

Session start/end are inside the ranged timings. The modes run in an order
rotated per repeat; every figure is the min / median / max over the repeats
and ``ranged/whole`` is the median of the per-repeat ratios (with its spread).
Loopback: a private master and a writer client with the segment in this
process. ``--netns RATE``: the master and a storage node on their own
namespace hosts, the reader on a third behind a ``tbf`` link of RATE.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch

from layerlift.bench.args import BenchParser, int_at_least
from layerlift.bench.netns_link import rate_arg
from layerlift.bench.output import add_output_options, write_outputs
from layerlift.bench.results import plot, render
from layerlift.bench.stats import spread
from layerlift.linker.master import EmbeddedMaster
from layerlift.linker.mooncake_config import MooncakeConfig
from layerlift.linker.mooncake_store import MooncakeStore
from layerlift.linker.store_base import StoreObjectLeased

LAYERS = 8
KV_HEADS, HEAD_DIM, DTYPE_BYTES = 8, 128, 2
PAGE_SIZES = (16, 64, 128)
DEPTH = 4
MODES = ("whole", "ranged d1", f"ranged d{DEPTH}")


def layer_bytes(page_size: int) -> int:
    """K+V bytes of one layer of one page."""
    return 2 * page_size * KV_HEADS * HEAD_DIM * DTYPE_BYTES


class _Reads:
    """The three read modes of one page size over `n` registered objects."""

    def __init__(self, reader: MooncakeStore, keys: list[str], piece: int, pool: Any) -> None:
        self.reader, self.keys, self.piece, self.pool = reader, keys, piece, pool
        n = len(keys)
        self.whole = torch.empty(n, LAYERS * piece, dtype=torch.uint8)
        self.ranged = torch.empty(LAYERS, n, piece, dtype=torch.uint8)
        reader.register(self.whole)
        reader.register(self.ranged)

    def close(self) -> None:
        self.reader.unregister(int(self.whole.data_ptr()))
        self.reader.unregister(int(self.ranged.data_ptr()))

    def read_whole(self) -> None:
        n, obj = len(self.keys), LAYERS * self.piece
        ptrs = [int(self.whole[i].data_ptr()) for i in range(n)]
        assert all(self.reader.get(self.keys, ptrs, [obj] * n))

    def _layer(self, layer: int) -> None:
        n = len(self.keys)
        self.reader.get_ranges(
            self.keys,
            [[int(self.ranged[layer, i].data_ptr())] for i in range(n)],
            [[self.piece]] * n,
            [[layer * self.piece]] * n,
        )

    def read_ranged(self, depth: int) -> None:
        with self.reader.open_session(self.keys):
            if depth == 1:
                for layer in range(LAYERS):
                    self._layer(layer)
            else:
                list(self.pool.map(self._layer, range(LAYERS)))


def measure(
    writer: MooncakeStore, reader: MooncakeStore, page_size: int, total: int, repeats: int
) -> dict[str, Any]:
    """Put `total` bytes of page objects through `writer`, read them `repeats` times."""
    piece = layer_bytes(page_size)
    obj = LAYERS * piece
    n = max(1, total // obj)
    keys = [f"bench-{time.monotonic_ns()}/ps{page_size}/{i}" for i in range(n)]
    src = torch.randint(0, 256, (n, obj), dtype=torch.uint8)
    writer.register(src)
    with ThreadPoolExecutor(DEPTH) as pool:
        reads = _Reads(reader, keys, piece, pool)
        try:
            writer.put(keys, [int(src[i].data_ptr()) for i in range(n)], [obj] * n)
            runs: dict[str, Callable[[], None]] = {
                MODES[0]: reads.read_whole,
                MODES[1]: lambda: reads.read_ranged(1),
                MODES[2]: lambda: reads.read_ranged(DEPTH),
            }
            runs[MODES[0]]()  # warm-up: connections, first touch of the buffers
            seconds: dict[str, list[float]] = {m: [] for m in MODES}
            for rep in range(repeats):
                order = MODES[rep % len(MODES) :] + MODES[: rep % len(MODES)]
                for mode in order:
                    start = time.perf_counter()
                    runs[mode]()
                    seconds[mode].append(time.perf_counter() - start)
            assert torch.equal(reads.whole, src)
            assert torch.equal(reads.ranged, src.view(n, LAYERS, piece).transpose(0, 1))
        finally:
            reads.close()
            writer.unregister(int(src.data_ptr()))
    with contextlib.suppress(StoreObjectLeased):  # best effort: a leased object stays
        writer.remove(keys)  # until its read lease lapses
    nbytes = n * obj
    gbps = {m: [nbytes / s / 1e9 for s in seconds[m]] for m in MODES}
    out: dict[str, Any] = {
        "objects": n, "object_bytes": obj, "layer_piece_bytes": piece, "total_bytes": nbytes,
        "repeats": repeats, "gbps": {m: spread(gbps[m]) for m in MODES},
    }  # fmt: skip
    for mode in MODES[1:]:
        paired = [r / w for r, w in zip(gbps[mode], gbps[MODES[0]], strict=True)]
        out[f"{mode} / whole"] = spread(paired)
    return out


def _run(writer: MooncakeStore, reader: MooncakeStore, total: int, repeats: int) -> dict[str, Any]:
    return {str(ps): measure(writer, reader, ps, total, repeats) for ps in PAGE_SIZES}


def run_loopback(total: int, repeats: int) -> dict[str, Any]:
    with EmbeddedMaster(lease_ttl_ms=5000, http_metadata=False) as master:  # long leases
        writer = MooncakeStore(master.config(global_segment_size=256 << 20, timeout_s=60.0))
        reader = MooncakeStore(
            master.config(global_segment_size=0, local_buffer_size=16 << 20, timeout_s=60.0)
        )
        with writer, reader:
            return _run(writer, reader, total, repeats)


def run_cluster(master: str, total: int, repeats: int) -> dict[str, Any]:
    """One pure client writes into and reads from a storage node elsewhere."""
    from layerlift.engine.stores import route_source

    config = MooncakeConfig(
        master_address=master, local_hostname=route_source(master), global_segment_size=0,
        local_buffer_size=16 << 20, timeout_s=60.0,
    )  # fmt: skip
    client = MooncakeStore(config)
    try:
        return _run(client, client, total, repeats)
    finally:
        client.close()


def run_netns(rate: str, total: int, repeats: int) -> dict[str, Any]:
    from layerlift.bench.netns_link import engine_host_json, netns_cluster

    with tempfile.TemporaryDirectory(prefix="layerlift-store-") as tmp, netns_cluster(
        rate, 4 * total + (64 << 20), tmp
    ) as (hosts, master):
        out = Path(tmp) / "store.json"
        argv = [sys.executable, "-m", "layerlift.bench.store", "--cluster", master,
                "--repeats", str(repeats), "--bytes", str(total), "--json", str(out)]  # fmt: skip
        page_sizes: dict[str, Any] = engine_host_json(hosts, argv, tmp, out)["page_sizes"]
        return page_sizes


def _print(link: str, results: dict[str, Any]) -> None:
    print(f"{link}: GB/s min/median/max over {next(iter(results.values()))['repeats']} repeats")
    print(f"{'page':>5} {'piece KiB':>9} " + " ".join(f"{m:>20}" for m in MODES)
          + f" {'d1/whole':>17} {f'd{DEPTH}/whole':>17}")  # fmt: skip
    for ps, r in results.items():
        cells = [f"{g['min']:.2f}/{g['median']:.2f}/{g['max']:.2f}" for g in r["gbps"].values()]
        ratios = [r[f"{m} / whole"] for m in MODES[1:]]
        print(f"{ps:>5} {r['layer_piece_bytes'] / 1024:>9.0f} "
              + " ".join(f"{c:>20}" for c in cells) + " "
              + " ".join(f"{q['min']:.2f}/{q['median']:.2f}/{q['max']:.2f}".rjust(17)
                         for q in ratios))  # fmt: skip



def build_parser() -> argparse.ArgumentParser:
    parser = BenchParser("layerlift bench store", __doc__.splitlines()[0])
    add_output_options(parser)
    parser.add_argument("--repeats", type=int_at_least(1), default=9, help="repeats per mode")
    parser.add_argument("--bytes", type=int_at_least(1 << 20), default=64 << 20,
                        help="bytes moved per page size and repeat")
    parser.add_argument("--netns", type=rate_arg, default=None, metavar="RATE",
                        help="also over a namespace link throttled to RATE (e.g. 1gbit; "
                             "needs root)")
    parser.add_argument("--cluster", default=None, help=argparse.SUPPRESS)  # on the engine host
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.cluster:
        page_sizes = run_cluster(args.cluster, args.bytes, args.repeats)
        if args.json is not None:
            Path(args.json).write_text(json.dumps({"page_sizes": page_sizes}))
        return 0
    links = {"mooncake-tcp-loopback": run_loopback(args.bytes, args.repeats)}
    _print("mooncake-tcp-loopback", links["mooncake-tcp-loopback"])
    if args.netns:
        label = f"mooncake-tcp-netns {args.netns}"
        links[label] = run_netns(args.netns, args.bytes, args.repeats)
        _print(label, links[label])
    report: dict[str, Any] = {
        "links": links,
        "layers_per_object": LAYERS,
        "layout": f"{KV_HEADS} kv heads x {HEAD_DIM} head dim, bf16, K+V",
        "depth": DEPTH,
        "timing": "modes rotated per repeat; ranged includes session start/end; "
        "ratios are per-repeat (paired) ratios of GB/s",
    }
    write_outputs("store", report, args, argv, render, plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
