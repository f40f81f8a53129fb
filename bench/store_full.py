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
from layerlift.bench.args import BenchParser, float_above, int_at_least
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


def _fraction(text: str) -> float:
    value = float_above(0)(text)
    if value > 1:
        raise argparse.ArgumentTypeError(f"expected a fraction in (0, 1], got {text!r}")
    return value


def build_parser() -> argparse.ArgumentParser:
    ap = BenchParser("layerlift bench store-full", __doc__.splitlines()[0])
    add_output_options(ap)
    presets = ModelSpec.preset_names()
    ap.add_argument("--preset", default="tiny", choices=presets, help="model preset")
    ap.add_argument("--prompts", type=int_at_least(1), default=48,
                    help="distinct prompts (the working set)")
    ap.add_argument("--tokens", type=int_at_least(1), default=2048, help="tokens per prompt")
    ap.add_argument("--requests", type=int_at_least(1), default=144,
                    help="requests, drawn from the prompts")
    ap.add_argument("--fractions", type=_fraction, nargs="+", default=[0.5],
                    help="store sizes as fractions of the working set's bytes, each in (0, 1]")
    ap.add_argument("--kl-samples", type=int_at_least(0), default=6,
                    help="restored requests checked against a cold recompute (KL)")
    ap.add_argument("--seed", type=int_at_least(0), default=0, help="prompt and request seed")
    return ap


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.ERROR)
    out = asyncio.run(main_async(args))
    print(render(write_outputs("store-full", out, args, argv, render, plot)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
