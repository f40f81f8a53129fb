"""A small serving loop on top of LayerLift's Engine and its Server.

Each request is one task: it submits its prompt to a
:class:`layerlift.engine.serve.Server` (continuous batching of prefills
under a token budget), takes the greedy token and submits prompt +
generated tokens again until it has ``--new-tokens`` tokens. The server
batches whatever is queued when the engine is free, so concurrent requests
share engine calls; TTFT is measured from the first submit. Decoding simply
re-runs prefill: the engine's radix tree turns that into a device hit up to
the last checkpoint plus a few computed tokens, and the result is exact. A
real server would decode with a KV cache; this loop only shows the API.

Prompts share a system prefix, so later requests hit the device cache or
restore from the store (``restored`` in the output).

    python examples/serving_loop.py --store memory --requests 8
    python examples/serving_loop.py --store embedded --requests 8   # real Mooncake
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from layerlift import Engine, EngineConfig, HybridModel, ModelSpec
from layerlift.engine.serve import ServeConfig, Server


@dataclass(eq=False)
class Request:
    """One request: its prompt, what it produced and its first-token times."""

    rid: int
    prompt: np.ndarray
    max_new_tokens: int
    generated: list[int] = field(default_factory=list)
    ttft: float | None = None
    restored_tokens: int = 0
    device_hit_tokens: int = 0

    def sequence(self) -> np.ndarray:
        return np.concatenate([self.prompt, np.asarray(self.generated, dtype=np.int64)])

    @property
    def finished(self) -> bool:
        return len(self.generated) >= self.max_new_tokens


async def run_request(server: Server, req: Request) -> None:
    """Submit until the request has all its tokens."""
    while not req.finished:
        served = await server.submit(req.sequence())
        res = served.result
        if req.ttft is None:
            req.ttft = served.ttft_s
            req.restored_tokens = res.restored_tokens
            req.device_hit_tokens = res.device_hit_tokens
        req.generated.append(int(res.next_token_logprobs.argmax()))


def make_prompts(vocab: int, n: int, system_len: int, user_len: int,
                 seed: int) -> list[np.ndarray]:
    """``n`` prompts: a shared system prefix, then a request-specific part."""
    rng = np.random.default_rng(seed)
    system = rng.integers(0, vocab, system_len, dtype=np.int64)
    return [np.concatenate([system, rng.integers(0, vocab, user_len + 3 * i,
                                                 dtype=np.int64)]) for i in range(n)]


async def serve(engine: Engine, prompts: Sequence[np.ndarray], *, max_batch: int,
                new_tokens: int, arrival_gap_s: float = 0.0,
                max_batch_tokens: int = 4096) -> list[Request]:
    """Feed ``prompts`` to a server (one every ``arrival_gap_s``) and return
    the finished requests, in arrival order."""
    requests = [Request(i, p, new_tokens) for i, p in enumerate(prompts)]
    cfg = ServeConfig(max_batch_tokens=max_batch_tokens, max_batch_requests=max_batch)
    async with Server(engine, cfg) as server:
        tasks = []
        for req in requests:
            tasks.append(asyncio.create_task(run_request(server, req)))
            await asyncio.sleep(arrival_gap_s)  # 0: just yield to the server
        await asyncio.gather(*tasks)
    return requests


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--store", choices=["memory", "embedded"], default="memory",
                    help="in-process store, or a real Mooncake master started for the run")
    ap.add_argument("--requests", type=int, default=8, help="number of requests")
    ap.add_argument("--max-batch", type=int, default=4, help="requests per engine call")
    ap.add_argument("--max-batch-tokens", type=int, default=4096, help="prompt tokens per call")
    ap.add_argument("--new-tokens", type=int, default=4, help="greedy tokens per request")
    ap.add_argument("--system-len", type=int, default=96, help="shared prefix tokens")
    ap.add_argument("--user-len", type=int, default=40, help="per-request tokens")
    ap.add_argument("--preset", default="tiny", choices=ModelSpec.preset_names())
    ap.add_argument("--policy", default="overlap", choices=["overlap", "barrier"])
    ap.add_argument("--arrival-gap-ms", type=float, default=0.0)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    if args.requests < 1 or args.new_tokens < 1:
        ap.error("--requests and --new-tokens must be at least 1")
    return args


async def amain(args: argparse.Namespace) -> list[Request]:
    spec = ModelSpec.preset(args.preset)
    model = HybridModel(spec, seed=args.seed)
    cfg = EngineConfig(store=args.store, policy=args.policy, pool_bytes=64 << 20,
                       segment_bytes=128 << 20)
    prompts = make_prompts(model.vocab_size, args.requests, args.system_len, args.user_len, args.seed)
    async with Engine(model, cfg) as engine:
        # Warm the store with the first prompt, then start from an empty device:
        # the shared prefix is restored once, then hit on the device.
        await engine.prefill(prompts[:1])
        await engine.wait_offloads()
        engine.drop_device_cache()
        t0 = time.perf_counter()
        done = await serve(engine, prompts, max_batch=args.max_batch,
                           new_tokens=args.new_tokens, arrival_gap_s=args.arrival_gap_ms / 1e3,
                           max_batch_tokens=args.max_batch_tokens)
        wall = time.perf_counter() - t0
        report = await engine.wait_offloads()
    for r in done:
        assert r.ttft is not None
        print(f"req {r.rid} ttft_ms={r.ttft * 1e3:.1f} prompt={len(r.prompt)} "
              f"restored={r.restored_tokens} device_hit={r.device_hit_tokens} "
              f"generated={','.join(map(str, r.generated))}")
    print(f"served {len(done)} requests, {sum(len(r.generated) for r in done)} tokens in "
          f"{wall * 1e3:.0f} ms; offloaded {report.objects} objects ({report.failed} failed)")
    return done


def main(argv: Sequence[str] | None = None) -> int:
    asyncio.run(amain(parse_args(argv)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
