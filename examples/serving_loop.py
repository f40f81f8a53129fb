"""A small continuous-batching serving loop on top of LayerLift's Engine.

Requests arrive on an asyncio queue. Every iteration the loop admits waiting
requests (up to ``--max-batch`` running at once) and runs *one*
``engine.prefill`` over every running sequence: a newly admitted request gets
its first token (its TTFT is measured from its arrival), a running one gets
its next greedy token. Decoding simply re-runs prefill on prompt + generated
tokens: the engine's radix tree turns that into a device hit up to the last
checkpoint plus a few computed tokens, and the result is exact. A real server
would decode with a KV cache; this loop only shows the engine's API.

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


@dataclass(eq=False)
class Request:
    """One request: its prompt, when it arrived, what it produced."""

    rid: int
    prompt: np.ndarray
    max_new_tokens: int
    arrival: float = field(default_factory=time.perf_counter)
    generated: list[int] = field(default_factory=list)
    ttft: float | None = None
    restored_tokens: int = 0
    device_hit_tokens: int = 0
    done: asyncio.Event = field(default_factory=asyncio.Event)

    def sequence(self) -> np.ndarray:
        return np.concatenate([self.prompt, np.asarray(self.generated, dtype=np.int64)])

    @property
    def finished(self) -> bool:
        return len(self.generated) >= self.max_new_tokens


class ServingLoop:
    """Admits requests from ``queue`` and steps every running one per iteration."""

    def __init__(self, engine: Engine, max_batch: int) -> None:
        if max_batch < 1:
            raise ValueError(f"max_batch must be at least 1, got {max_batch}")
        self.engine = engine
        self.max_batch = max_batch
        self.queue: asyncio.Queue[Request | None] = asyncio.Queue()
        self.iterations = 0

    async def submit(self, request: Request) -> None:
        request.arrival = time.perf_counter()
        await self.queue.put(request)

    async def run(self) -> None:
        """Serve until ``None`` was queued and every admitted request finished."""
        running: list[Request] = []
        closing = False
        while True:
            if not running and not closing:
                first = await self.queue.get()  # idle: wait for work
                if first is None:
                    closing = True
                else:
                    running.append(first)
            while not closing and len(running) < self.max_batch and not self.queue.empty():
                nxt = self.queue.get_nowait()
                if nxt is None:
                    closing = True
                else:
                    running.append(nxt)
            if not running:
                return
            await self._step(running)
            for req in [r for r in running if r.finished]:
                running.remove(req)
                req.done.set()

    async def _step(self, running: list[Request]) -> None:
        """One engine call for the whole batch: one greedy token per request."""
        self.iterations += 1
        results = await self.engine.prefill([r.sequence() for r in running])
        now = time.perf_counter()
        for req, res in zip(running, results, strict=True):
            if req.ttft is None:
                req.ttft = now - req.arrival
                req.restored_tokens = res.restored_tokens
                req.device_hit_tokens = res.device_hit_tokens
            req.generated.append(int(res.next_token_logprobs.argmax()))


def make_prompts(spec: ModelSpec, n: int, system_len: int, user_len: int,
                 seed: int) -> list[np.ndarray]:
    """``n`` prompts: a shared system prefix, then a request-specific part."""
    rng = np.random.default_rng(seed)
    system = rng.integers(0, spec.vocab_size, system_len, dtype=np.int64)
    return [np.concatenate([system, rng.integers(0, spec.vocab_size, user_len + 3 * i,
                                                 dtype=np.int64)]) for i in range(n)]


async def serve(engine: Engine, prompts: Sequence[np.ndarray], *, max_batch: int,
                new_tokens: int, arrival_gap_s: float = 0.0) -> list[Request]:
    """Feed ``prompts`` to a serving loop (one every ``arrival_gap_s``) and
    return the finished requests, in arrival order."""
    loop = ServingLoop(engine, max_batch)
    server = asyncio.create_task(loop.run())
    requests = [Request(i, p, new_tokens) for i, p in enumerate(prompts)]
    try:
        for req in requests:
            await loop.submit(req)
            await asyncio.sleep(arrival_gap_s)  # 0: just yield to the server
        await loop.queue.put(None)
        await server
    finally:
        server.cancel()
    return requests


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--store", choices=["memory", "embedded"], default="memory",
                    help="in-process store, or a real Mooncake master started for the run")
    ap.add_argument("--requests", type=int, default=8, help="number of requests")
    ap.add_argument("--max-batch", type=int, default=4, help="requests running at once")
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
    prompts = make_prompts(spec, args.requests, args.system_len, args.user_len, args.seed)
    async with Engine(model, cfg) as engine:
        # Warm the store with the first prompt, then start from an empty device:
        # the shared prefix is restored once, then hit on the device.
        await engine.prefill(prompts[:1])
        await engine.wait_offloads()
        engine.drop_device_cache()
        t0 = time.perf_counter()
        done = await serve(engine, prompts, max_batch=args.max_batch,
                           new_tokens=args.new_tokens, arrival_gap_s=args.arrival_gap_ms / 1e3)
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
