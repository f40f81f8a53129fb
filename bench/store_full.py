"""A store smaller than the working set: hit fraction against the ideal (issue 21).

    layerlift bench store-full [--json PATH] [--markdown PATH] [--plot PATH]
        [--prompts N] [--tokens T] [--requests R] [--fractions F ...]

``N`` distinct prompts of ``T`` tokens (the working set: what their offloads
put in the store) are requested ``R`` times in a seeded random order by an
engine whose device cache is emptied before every request (a new instance
each time: every hit comes from the store). The store is an embedded
Mooncake master whose only segment is a fraction of the working set's bytes
(``--fractions``; at least Mooncake's 16 MiB), so Mooncake evicts. The
*ideal* is the restored fraction with an unbounded store: every request
after a prompt's first is served from the store up to its last restorable
boundary. Reported per fraction: restored tokens / prompt tokens, that over
the ideal, puts that failed, offloads skipped by the back-off, and the
largest KL of a sample of results against cold runs (exactness).
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import time
from typing import Any

import numpy as np

from layerlift import Engine, EngineConfig, HybridModel, ModelSpec
from layerlift.bench.output import add_output_options, write_outputs
from layerlift.bench.results import plot, render
from layerlift.linker.memory_store import MemoryStore
from layerlift.testing import kl_divergence

MIN_SEGMENT = 16 << 20


async def _working_set_bytes(model: HybridModel, prompts: list[np.ndarray], pool: int) -> int:
    store = MemoryStore()
    async with Engine(model, EngineConfig(store="memory", pool_bytes=pool), store=store) as e:
        for p in prompts:
            await e.prefill([p])
            await e.wait_offloads()
            e.drop_device_cache()
    return store.used_bytes


async def _run(model: HybridModel, prompts: list[np.ndarray], order: list[int],
               segment: int, pool: int, refs: dict[int, Any]) -> dict[str, Any]:
    cfg = EngineConfig(store="embedded", segment_bytes=segment, pool_bytes=pool,
                       store_timeout_s=30.0)
    seen: set[int] = set()
    restored = total = 0
    kls: list[float] = []
    t0 = time.perf_counter()
    async with Engine(model, cfg) as e:
        for i in order:
            e.drop_device_cache()
            (r,) = await e.prefill([prompts[i]])
            await e.wait_offloads()
            if i in seen:  # the ideal can serve only repeats
                restored += r.restored_tokens
                total += len(prompts[i])
            seen.add(i)
            if i in refs and r.restored_tokens:
                kls.append(kl_divergence(refs[i].next_token_logprobs, r.next_token_logprobs))
        report = e.offloader.report
    return {"segment_bytes": segment, "restored_fraction": restored / max(total, 1),
            "puts_failed": report.failed, "failures": dict(report.failures),
            "backed_off": report.backed_off, "too_big": report.too_big,
            "max_kl_sampled": max(kls, default=0.0), "kl_samples": len(kls),
            "seconds": time.perf_counter() - t0}


async def main_async(args: argparse.Namespace) -> dict[str, Any]:
    model = HybridModel(ModelSpec.preset(args.preset), seed=0)
    rng = np.random.default_rng(args.seed)
    prompts = [rng.integers(0, model.vocab_size, args.tokens, dtype=np.int64)
               for _ in range(args.prompts)]
    order = [int(i) for i in rng.integers(0, args.prompts, args.requests)]
    pool = 64 << 20
    ws = await _working_set_bytes(model, prompts, pool)
    refs: dict[int, Any] = {}
    async with Engine(model, EngineConfig(store="memory", offload=False, pool_bytes=pool)) as e:
        for i in sorted(set(order))[: args.kl_samples]:
            (refs[i],) = await e.prefill([prompts[i]])
    ideal = await _run(model, prompts, order, max(2 * ws, MIN_SEGMENT), pool, refs)
    rows = []
    for f in args.fractions:
        segment = max(int(f * ws), MIN_SEGMENT)
        row = await _run(model, prompts, order, segment, pool, refs)
        row.update(fraction_of_working_set=segment / ws,
                   of_ideal=row["restored_fraction"] / max(ideal["restored_fraction"], 1e-9))
        rows.append(row)
    return {"preset": args.preset, "prompts": args.prompts, "tokens": args.tokens,
            "requests": args.requests, "working_set_bytes": ws, "ideal": ideal, "rows": rows}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="layerlift bench store-full",
                                 description=__doc__.splitlines()[0])
    add_output_options(ap)
    ap.add_argument("--preset", default="tiny", choices=ModelSpec.preset_names())
    ap.add_argument("--prompts", type=int, default=48)
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--requests", type=int, default=144)
    ap.add_argument("--fractions", type=float, nargs="+", default=[0.5])
    ap.add_argument("--kl-samples", type=int, default=6)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.ERROR)
    out = asyncio.run(main_async(args))
    print(render(write_outputs("store-full", out, args, argv, render, plot)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
