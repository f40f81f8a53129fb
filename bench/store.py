"""Whole-object vs per-layer ranged reads from Mooncake Store over loopback TCP.

    python bench/store.py [--json PATH] [--quick]

Starts its own mooncake_master. A writer client (with a segment) puts N page
objects laid out layer-major (8 layers of K+V, 8 KV heads x 128 head dim, bf16);
a reader client with no segment of its own then reads the same bytes two ways:
(a) `get` of whole objects, (b) one `get_ranges` per layer over all pages
inside one session (session start/end included in the time). Best of 3.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

from layerlift.linker.master import EmbeddedMaster
from layerlift.linker.mooncake_store import MooncakeStore

LAYERS = 8
KV_HEADS, HEAD_DIM, DTYPE_BYTES = 8, 128, 2
PAGE_SIZES = (16, 64, 128)


def layer_bytes(page_size: int) -> int:
    """K+V bytes of one layer of one page."""
    return 2 * page_size * KV_HEADS * HEAD_DIM * DTYPE_BYTES


def measure(
    writer: MooncakeStore, reader: MooncakeStore, page_size: int, total: int, repeats: int
) -> dict[str, float]:
    piece = layer_bytes(page_size)
    obj = LAYERS * piece
    n = max(1, total // obj)
    keys = [f"bench/ps{page_size}/{i}" for i in range(n)]
    src = torch.randint(0, 256, (n, obj), dtype=torch.uint8)
    whole = torch.empty(n, obj, dtype=torch.uint8)
    ranged = torch.empty(LAYERS, n, piece, dtype=torch.uint8)
    writer.register(src)
    reader.register(whole)
    reader.register(ranged)
    try:
        writer.put(keys, [int(src[i].data_ptr()) for i in range(n)], [obj] * n)
        whole_s, ranged_s = [], []
        for _ in range(repeats):
            start = time.perf_counter()
            assert all(reader.get(keys, [int(whole[i].data_ptr()) for i in range(n)], [obj] * n))
            whole_s.append(time.perf_counter() - start)
            start = time.perf_counter()
            with reader.open_session(keys):
                for layer in range(LAYERS):
                    reader.get_ranges(
                        keys,
                        [[int(ranged[layer, i].data_ptr())] for i in range(n)],
                        [[piece]] * n,
                        [[layer * piece]] * n,
                    )
            ranged_s.append(time.perf_counter() - start)
        assert torch.equal(whole, src)
        assert torch.equal(ranged, src.view(n, LAYERS, piece).transpose(0, 1))
    finally:
        reader.unregister(int(whole.data_ptr()))
        reader.unregister(int(ranged.data_ptr()))
        writer.unregister(int(src.data_ptr()))
    writer.remove(keys)  # best effort: objects under a read lease stay until it lapses
    nbytes = n * obj
    whole_gbps = nbytes / min(whole_s) / 1e9
    ranged_gbps = nbytes / min(ranged_s) / 1e9
    return {
        "objects": n,
        "object_bytes": obj,
        "layer_piece_bytes": piece,
        "total_bytes": nbytes,
        "whole_gbps": round(whole_gbps, 3),
        "ranged_gbps": round(ranged_gbps, 3),
        "ranged_over_whole": round(ranged_gbps / whole_gbps, 3),
        "whole_s_median": round(statistics.median(whole_s), 5),
        "ranged_s_median": round(statistics.median(ranged_s), 5),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", type=Path, default=None, help="write results as JSON")
    parser.add_argument("--quick", action="store_true", help="16 MiB per page size")
    args = parser.parse_args(argv)
    total = (16 if args.quick else 64) << 20
    results: dict[str, dict[str, float]] = {}
    with EmbeddedMaster(lease_ttl_ms=5000) as master:  # leases must outlast a transfer
        writer = MooncakeStore(master.config(global_segment_size=256 << 20, timeout_s=60.0))
        reader = MooncakeStore(
            master.config(global_segment_size=0, local_buffer_size=16 << 20, timeout_s=60.0)
        )
        with writer, reader:
            for page_size in PAGE_SIZES:
                results[str(page_size)] = measure(writer, reader, page_size, total, repeats=3)
    print(f"{'page':>5} {'piece KiB':>9} {'objects':>7} {'whole GB/s':>10} "
          f"{'ranged GB/s':>11} {'ranged/whole':>12}")  # fmt: skip
    for page_size, r in results.items():
        print(
            f"{page_size:>5} {r['layer_piece_bytes'] / 1024:>9.0f} {r['objects']:>7} "
            f"{r['whole_gbps']:>10.3f} {r['ranged_gbps']:>11.3f} {r['ranged_over_whole']:>12.3f}"
        )
    if args.json is not None:
        report = {
            "page_sizes": results,
            "link": "mooncake-tcp-loopback",
            "layers_per_object": LAYERS,
            "layout": f"{KV_HEADS} kv heads x {HEAD_DIM} head dim, bf16, K+V",
            "timing": "best of 3; ranged includes session start/end",
        }
        args.json.write_text(json.dumps(report, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
