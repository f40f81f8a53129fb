"""What end-to-end integrity costs (issue 21): CRC-32C per layer slice.

    layerlift bench integrity [--json PATH] [--markdown PATH] [--plot PATH] [--repeats N]
        [--mooncake]

1. ``crc``: the verification of one layer of a restored batch (the hot
   path: ``integrity.mismatches`` over N slices, seeded with their keys) and
   the footers of an offload (``integrity.page_footers``), in GB of slice
   bytes per second of one CPU thread, for slice sizes from 8 KiB to 1 MiB
   (about 64 MiB of slices per point), with the CRC-32C LayerLift uses
   (``integrity.CRC_IMPLEMENTATION``: ``awscrt``'s folding code where it
   is installed), the same loop with the ``crc32c`` package's CRC-32C (the
   fallback, where LayerLift's is another code), and beside it the same
   loop with CRC-32 (the objects' checksum before format ``l3``), ISA-L's
   (where the ``isal`` package is installed: the dev extra) and zlib's.
   A vectorised integer hash in torch
   (int16 words times weights, summed in float64: exact) is measured beside
   it, since that is what a "per layer, all pages at once" torch op costs.
2. ``--mooncake``: one layer of 64 page objects (256 KiB slices, 8 layers)
   read with ``get_ranges`` from a private loopback master three ways,
   medians of interleaved repeats: the slice alone (``plain``), the slice
   plus its 4-byte footer entry as a second range per object (``entry``),
   and the slice plus the whole footer (``footer``: what a component's
   first layer reads). The engine's design (whole footers with the first
   layer, later layers plain) costs ``(footer - plain) / (layers * plain)``
   of a restore; one entry per layer would cost ``entry / plain - 1``.

Every figure is the median of ``--repeats`` runs; the JSON records the
machine's CPU count and torch's thread count (the CRC is one call per slice
on one thread; every CRC here releases the GIL, so fetch threads verify in
parallel).
"""

from __future__ import annotations

import argparse
import ctypes
import os
import statistics
import tempfile
import time
import uuid
import zlib
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import torch

from layerlift.bench.args import BenchParser, int_at_least
from layerlift.bench.output import add_output_options, write_outputs
from layerlift.bench.results import plot, render
from layerlift.linker.integrity import (
    CHECK_BYTES,
    CRC_IMPLEMENTATION,
    checksums,
    crc32c_package,
    mismatches,
    slice_seed,
)

SIZES = (8 << 10, 32 << 10, 128 << 10, 256 << 10, 1 << 20)
TOTAL = 64 << 20


def _median_s(fn: Callable[[], object], repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _torch_hash(buf: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """An exact vectorised hash of every row at once (int16 words x weights,
    float64 sums stay below 2**53): the torch alternative to a CRC loop."""
    return buf.view(torch.int16).to(torch.float64) @ weights


def _crc32_loop(crc: Callable[..., int], ptrs: list[int], size: int, seeds: list[int]) -> int:
    """The loop of ``mismatches`` with another CRC function (zlib's or
    ISA-L's CRC-32: what a verify cost with format ``l2``'s checksum; the
    ``crc32c`` package's CRC-32C)."""
    acc = 0
    for ptr, seed in zip(ptrs, seeds, strict=True):
        view = memoryview((ctypes.c_char * size).from_address(ptr)).cast("B")
        acc ^= crc(view, seed)
    return acc


def _isal_crc32() -> Callable[..., int] | None:
    try:
        from isal.isal_zlib import crc32
    except ImportError:  # the dev extra is not installed: that column is left out
        return None
    return crc32


def crc_points(repeats: int) -> list[dict[str, Any]]:
    rows = []
    isal = _isal_crc32()
    package, package_name = crc32c_package()
    for size in SIZES:
        n = max(1, TOTAL // size)
        buf = torch.randint(0, 256, (n, size), dtype=torch.uint8)
        ptrs = [int(buf[i].data_ptr()) for i in range(n)]
        seeds = [slice_seed(f"ns/fp.l3/full/0/{i:08x}", 3) for i in range(n)]
        expected = checksums(ptrs, size, seeds)
        verify_s = _median_s(partial(mismatches, ptrs, size, expected, seeds), repeats)
        package_s = None if package_name == CRC_IMPLEMENTATION else \
            _median_s(partial(_crc32_loop, package, ptrs, size, seeds), repeats)
        zlib_s = _median_s(partial(_crc32_loop, zlib.crc32, ptrs, size, seeds), repeats)
        isal_s = None if isal is None else \
            _median_s(partial(_crc32_loop, isal, ptrs, size, seeds), repeats)
        weights = torch.randint(1, 1 << 20, (size // 2,), dtype=torch.int64).to(torch.float64)
        torch_s = _median_s(partial(_torch_hash, buf, weights), repeats)
        gb = n * size / 1e9
        rows.append({
            "slice_bytes": size, "slices": n, "gb": gb,
            "crc_verify_gbps": gb / verify_s, "crc_ms_per_gb": verify_s / gb * 1e3,
            **({} if package_s is None else {"crc32c_package_gbps": gb / package_s}),
            "zlib_crc32_gbps": gb / zlib_s,
            **({} if isal_s is None else {"isal_crc32_gbps": gb / isal_s}),
            "torch_hash_gbps": gb / torch_s, "torch_hash_ms_per_gb": torch_s / gb * 1e3,
        })
    return rows


def mooncake_point(repeats: int) -> dict[str, Any]:
    from layerlift.linker.master import EmbeddedMaster
    from layerlift.linker.mooncake_store import MooncakeStore

    n, slice_bytes, layers = 64, 256 << 10, 8
    page = slice_bytes * layers
    with tempfile.TemporaryDirectory() as tmp, \
            EmbeddedMaster(log_path=Path(tmp) / "master.log", lease_ttl_ms=5000) as master, \
            MooncakeStore(master.config(global_segment_size=256 << 20,
                                        local_buffer_size=32 << 20)) as store:
        src = torch.randint(0, 256, (n, page + layers * CHECK_BYTES), dtype=torch.uint8)
        dst = torch.zeros(n, slice_bytes, dtype=torch.uint8)
        foot = torch.zeros(n, layers * CHECK_BYTES, dtype=torch.uint8)
        for t in (src, dst, foot):
            store.register(t)
        keys = [f"bench-{uuid.uuid4().hex[:8]}/{i}" for i in range(n)]
        store.put(keys, [int(src[i].data_ptr()) for i in range(n)], [src.shape[1]] * n)
        plain = ([[int(dst[i].data_ptr())] for i in range(n)], [[slice_bytes]] * n,
                 [[slice_bytes]] * n)
        ptrs2 = [[int(dst[i].data_ptr()), int(foot[i].data_ptr())] for i in range(n)]
        variants = {
            "plain": plain,
            "entry": (ptrs2, [[slice_bytes, CHECK_BYTES]] * n,
                      [[slice_bytes, page + CHECK_BYTES]] * n),
            "footer": (ptrs2, [[slice_bytes, layers * CHECK_BYTES]] * n, [[slice_bytes, page]] * n),
        }
        times: dict[str, list[float]] = {k: [] for k in variants}
        with store.open_session(keys):
            names = list(variants)
            for r in range(repeats + 1):
                for name in names[r % 3:] + names[: r % 3]:  # rotated order
                    t0 = time.perf_counter()
                    store.get_ranges(keys, *variants[name])
                    if r:
                        times[name].append(time.perf_counter() - t0)
        ok = bool(torch.equal(dst, src[:, slice_bytes : 2 * slice_bytes]))
    med = {k: statistics.median(v) for k, v in times.items()}
    return {"objects": n, "slice_bytes": slice_bytes, "layers": layers,
            **{f"{k}_ms": v * 1e3 for k, v in med.items()},
            "entry_per_layer_overhead": med["entry"] / med["plain"] - 1,
            "design_overhead_per_restore": (med["footer"] - med["plain"]) / (layers * med["plain"]),
            "bytes_exact": ok}


def build_parser() -> argparse.ArgumentParser:
    ap = BenchParser("layerlift bench integrity", __doc__.splitlines()[0])
    add_output_options(ap)
    ap.add_argument("--repeats", type=int_at_least(1), default=7,
                    help="repeats per measurement (the median is reported)")
    ap.add_argument("--mooncake", action="store_true",
                    help="also time the footer reads against a real Mooncake master on loopback")
    return ap


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    out: dict[str, Any] = {
        "what": "CRC-32C per layer slice: verify throughput per CPU thread; footer read cost",
        "cpus": os.cpu_count(), "torch_threads": torch.get_num_threads(),
        "zlib": zlib.ZLIB_RUNTIME_VERSION, "crc_implementation": CRC_IMPLEMENTATION,
        "repeats": args.repeats,
        "crc": crc_points(args.repeats),
    }
    if args.mooncake:
        out["mooncake_footer_read"] = mooncake_point(args.repeats)
    print(render(write_outputs("integrity", out, args, argv, render, plot)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
