"""The serving loop (``layerlift.engine.serve``): token budget, FIFO,
backpressure, shutdown both ways, exact results, engine errors per batch.

A real engine runs every batch; :class:`GatedEngine` only holds a batch at
the engine's door until a test releases it, so tests order tasks with events."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

import numpy as np
import pytest

from layerlift import Engine, EngineConfig, EngineError, HybridModel, ModelSpec, PrefillResult
from layerlift.engine.serve import QueueFull, ServeConfig, Server, ServerClosed
from layerlift.linker.mooncake_store import MooncakeStore
from layerlift.testing import KL_EXACT, kl_divergence

SPEC = ModelSpec.preset("tiny")


class GatedEngine:
    """Delegates ``prefill`` to a real engine; records every batch's prompt
    lengths; batch ``i`` waits for ``release(i)`` when gated, and fails with
    ``EngineError`` when listed in ``fail``; any batch holding a prompt of a
    length in ``poison`` fails with ``EngineError`` (an error that belongs to
    that request)."""

    def __init__(self, engine: Engine, gated: Sequence[int] = (), fail: Sequence[int] = (),
                 poison: Sequence[int] = ()) -> None:
        self.engine = engine
        self.model = engine.model
        self.batches: list[list[int]] = []
        self.entered = [asyncio.Event() for _ in range(16)]
        self.gates = {i: asyncio.Event() for i in gated}
        self.fail = set(fail)
        self.poison = set(poison)

    def release(self, i: int) -> None:
        self.gates[i].set()

    async def prefill(self, prompts: Sequence[Sequence[int] | np.ndarray]) -> list[PrefillResult]:
        i = len(self.batches)
        self.batches.append([len(p) for p in prompts])
        self.entered[i].set()
        if i in self.gates:
            await self.gates[i].wait()
        if i in self.fail:
            raise EngineError(f"injected failure of batch {i}")
        bad = [len(p) for p in prompts if len(p) in self.poison]
        if bad:
            raise EngineError(f"injected failure of the {bad[0]}-token request")
        return await self.engine.prefill(prompts)


def prompt(n: int, seed: int, shared: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    head = np.random.default_rng(999).integers(0, SPEC.dims.vocab_size, shared)
    return np.concatenate([head, rng.integers(0, SPEC.dims.vocab_size, n - shared)]).astype(np.int64)


@pytest.fixture
async def engine(tiny_model: HybridModel) -> Engine:
    async with Engine(tiny_model, EngineConfig(store="memory", pool_bytes=16 << 20)) as eng:
        yield eng  # type: ignore[misc]


async def yield_until(cond: object, limit: int = 200) -> None:
    """Give other tasks turns (no wall-clock sleep) until ``cond()`` holds."""
    for _ in range(limit):
        if cond():  # type: ignore[operator]
            return
        await asyncio.sleep(0)
    raise AssertionError("condition never held")


async def test_budget_is_respected_in_fifo_order(engine: Engine) -> None:
    gated = GatedEngine(engine, gated=[0])
    sizes = [100, 120, 150, 60, 300, 40, 40]
    async with Server(gated, ServeConfig(max_batch_tokens=280)) as server:
        first = asyncio.create_task(server.submit(prompt(sizes[0], 0)))
        await gated.entered[0].wait()  # batch 0 holds the engine; the rest queue up
        rest = [server.submit_nowait(prompt(n, i + 1)) for i, n in enumerate(sizes[1:])]
        assert server.queued == len(sizes) - 1
        gated.release(0)
        served = [await first, *[await f for f in rest]]
    # FIFO packing under 280: [120, 150] (+60 would be 330), [60] (+300 > 280),
    # [300] alone (larger than the budget), [40, 40].
    assert gated.batches == [[100], [120, 150], [60], [300], [40, 40]]
    assert [s.batch_id for s in served] == [0, 1, 1, 2, 3, 4, 4]
    for s, n in zip(served, sizes, strict=True):
        r = s.result
        assert r.device_hit_tokens + r.restored_tokens + r.computed_tokens == n
        assert 0 <= s.queue_s <= s.ttft_s
    assert server.stats.batches == 5 and server.stats.served == len(sizes)


async def test_batch_request_cap(engine: Engine) -> None:
    gated = GatedEngine(engine, gated=[0])
    async with Server(gated, ServeConfig(max_batch_tokens=10_000, max_batch_requests=2)) as server:
        first = asyncio.create_task(server.submit(prompt(50, 0)))
        await gated.entered[0].wait()
        rest = [server.submit_nowait(prompt(50, i)) for i in range(1, 6)]
        gated.release(0)
        await first
        await asyncio.gather(*rest)
    assert [len(b) for b in gated.batches] == [1, 2, 2, 1]


async def test_backpressure_submit_waits_and_submit_nowait_raises(engine: Engine) -> None:
    gated = GatedEngine(engine, gated=[0])
    async with Server(gated, ServeConfig(max_queue=2, max_batch_requests=1)) as server:
        first = asyncio.create_task(server.submit(prompt(40, 0)))
        await gated.entered[0].wait()
        queued = [server.submit_nowait(prompt(40, 1)), server.submit_nowait(prompt(40, 2))]
        with pytest.raises(QueueFull, match="max_queue=2"):
            server.submit_nowait(prompt(40, 3))
        blocked = asyncio.create_task(server.submit(prompt(40, 4)))
        await yield_until(lambda: server.queued == 2)
        for _ in range(20):
            await asyncio.sleep(0)
        assert not blocked.done() and server.queued == 2  # waits for room, not queued
        gated.release(0)
        await first
        await asyncio.gather(*queued)
        last = await blocked
    assert last.batch_id == 3  # admitted after the two queued ones


async def test_close_finishes_what_is_queued(engine: Engine) -> None:
    gated = GatedEngine(engine, gated=[0])
    server = Server(gated, ServeConfig(max_batch_requests=1))
    server.start()
    first = asyncio.create_task(server.submit(prompt(40, 0)))
    await gated.entered[0].wait()
    queued = [server.submit_nowait(prompt(40, i)) for i in (1, 2)]
    closing = asyncio.create_task(server.aclose())
    await yield_until(lambda: server._closing)
    with pytest.raises(ServerClosed, match="closing"):
        server.submit_nowait(prompt(40, 3))
    gated.release(0)
    await closing
    assert (await first).batch_id == 0
    assert [(await f).batch_id for f in queued] == [1, 2]
    assert server.stats.dropped == 0


async def test_close_with_cancel_fails_queued_and_blocked_requests(engine: Engine) -> None:
    gated = GatedEngine(engine, gated=[0])
    server = Server(gated, ServeConfig(max_batch_requests=1, max_queue=2))
    server.start()
    first = asyncio.create_task(server.submit(prompt(40, 0)))
    await gated.entered[0].wait()
    queued = [server.submit_nowait(prompt(40, i)) for i in (1, 2)]
    blocked = asyncio.create_task(server.submit(prompt(40, 3)))
    await yield_until(lambda: server.queued == 2)
    closing = asyncio.create_task(server.aclose(cancel_pending=True))
    await yield_until(lambda: server.queued == 0)
    gated.release(0)
    await closing
    assert (await first).result.computed_tokens == 40  # the running batch finished
    for f in queued:
        with pytest.raises(ServerClosed, match="before this request ran"):
            await f
    with pytest.raises(ServerClosed):
        await blocked
    assert gated.batches == [[40]] and server.stats.dropped == 2
    with pytest.raises(ServerClosed):
        await server.submit(prompt(40, 4))


async def test_engine_error_fails_its_batch_only(engine: Engine) -> None:
    """A batch whose every request fails alone too (an outage of the whole
    engine): each request gets the error; the next batch is served."""
    gated = GatedEngine(engine, gated=[0], fail=[1, 2, 3])
    async with Server(gated, ServeConfig(max_batch_tokens=100)) as server:
        first = asyncio.create_task(server.submit(prompt(90, 0)))
        await gated.entered[0].wait()
        doomed = [server.submit_nowait(prompt(45, i)) for i in (1, 2)]
        after = server.submit_nowait(prompt(80, 3))
        gated.release(0)
        await first
        for f in doomed:
            with pytest.raises(EngineError, match="injected failure of batch"):
                await f
        assert (await after).batch_id == 2
        again = await server.submit(prompt(80, 3))  # still serving; the device cache hits
    assert again.result.device_hit_tokens > 0
    assert gated.batches[1:4] == [[45, 45], [45], [45]]  # split, then each alone
    assert server.stats.failed == 2 and server.stats.splits == 1


async def test_an_engine_error_of_one_request_fails_that_request_only(engine: Engine) -> None:
    """Issue 21, finding 4: the request the error belongs to fails; the
    others of its batch are served (exact: the same as alone)."""
    gated = GatedEngine(engine, gated=[0], poison=[33])
    async with Server(gated, ServeConfig(max_batch_tokens=1000)) as server:
        first = asyncio.create_task(server.submit(prompt(40, 0)))
        await gated.entered[0].wait()
        good = [server.submit_nowait(prompt(n, i)) for i, n in ((1, 50), (2, 60), (3, 70))]
        bad = server.submit_nowait(prompt(33, 4))
        good.append(server.submit_nowait(prompt(80, 5)))
        gated.release(0)
        await first
        served = [await f for f in good]
        with pytest.raises(EngineError, match="33-token request"):
            await bad
    assert [len(b) for b in gated.batches[:2]] == [1, 5]
    assert all(s.result.computed_tokens + s.result.device_hit_tokens + s.result.restored_tokens
               == n for s, n in zip(served, (50, 60, 70, 80), strict=True))
    assert server.stats.failed == 1 and server.stats.served == 5


async def test_a_prompt_that_cannot_fit_fails_alone(tiny_model: HybridModel) -> None:
    """A real engine error that names one request (a prompt too large for
    the pool) fails that request; the two valid prompts batched with it are
    served and exact."""
    small = [prompt(60, 1), prompt(70, 2)]
    async with Engine(tiny_model, EngineConfig(store="memory", pool_bytes=4 << 20,
                                               offload=False)) as eng:
        alone = [(await eng.prefill([p]))[0] for p in small]
        eng.drop_device_cache()
        gated = GatedEngine(eng, gated=[0])
        async with Server(gated, ServeConfig(max_batch_tokens=100_000)) as server:
            first = asyncio.create_task(server.submit(prompt(10, 9)))
            await gated.entered[0].wait()
            futs = [server.submit_nowait(small[0]), server.submit_nowait(prompt(20_000, 3)),
                    server.submit_nowait(small[1])]
            gated.release(0)
            await first
            with pytest.raises(EngineError, match="cannot fit"):
                await futs[1]
            got = [await futs[0], await futs[2]]
    for a, g in zip(alone, got, strict=True):
        assert kl_divergence(a.next_token_logprobs, g.result.next_token_logprobs) <= KL_EXACT


async def test_bad_prompts_are_refused_at_submit(engine: Engine) -> None:
    """Issue 21, finding 4: ``[1, 2, 3, 10**6]`` queued beside two valid
    prompts: its caller gets ValueError at once, the two are served."""
    async with Server(engine, ServeConfig(max_prompt_tokens=500)) as server:
        ok = [server.submit_nowait(prompt(40, 1)), server.submit_nowait(prompt(50, 2))]
        with pytest.raises(ValueError, match="outside the model's vocabulary"):
            server.submit_nowait([1, 2, 3, 10**6])
        with pytest.raises(ValueError, match="outside the model's vocabulary"):
            await server.submit([5, -1])
        with pytest.raises(ValueError, match="integers"):
            await server.submit([1.5, 2.0])
        with pytest.raises(ValueError, match="non-empty 1-D"):
            await server.submit([])
        with pytest.raises(ValueError, match="at most 500"):
            await server.submit(prompt(501, 3))
        served = [await f for f in ok]
    assert len(served) == 2 and server.stats.refused == 5 and server.stats.failed == 0


async def test_stats_stay_bounded(engine: Engine) -> None:
    """``batch_tokens`` keeps the last 1024 batches; totals are counters."""
    async with Server(engine, ServeConfig(max_batch_requests=1)) as server:
        for i in range(3):
            await server.submit(prompt(20 + i, i))
    assert list(server.stats.batch_tokens) == [20, 21, 22] and server.stats.tokens == 63
    assert server.stats.batch_tokens.maxlen == 1024


async def test_cancelled_awaiter_leaves_the_queue(engine: Engine) -> None:
    gated = GatedEngine(engine, gated=[0])
    async with Server(gated, ServeConfig(max_batch_requests=1)) as server:
        first = asyncio.create_task(server.submit(prompt(40, 0)))
        await gated.entered[0].wait()
        gone = asyncio.create_task(server.submit(prompt(40, 1)))
        kept = asyncio.create_task(server.submit(prompt(40, 2)))
        await yield_until(lambda: server.queued == 2)
        gone.cancel()
        gated.release(0)
        await first
        assert (await kept).batch_id == 1
    assert gated.batches == [[40], [40]]


async def test_prefetch_hands_the_next_batch_over_while_one_runs(engine: Engine) -> None:
    gated = GatedEngine(engine, gated=[0, 1])
    cfg = ServeConfig(max_batch_requests=1, prefetch=True)
    async with Server(gated, cfg) as server:
        assert server.prefetch_active
        first = asyncio.create_task(server.submit(prompt(40, 0)))
        await gated.entered[0].wait()
        second = server.submit_nowait(prompt(40, 1))
        await asyncio.wait_for(gated.entered[1].wait(), 30)  # batch 0 still held
        third = server.submit_nowait(prompt(40, 2))
        for _ in range(50):
            await asyncio.sleep(0)
        assert not gated.entered[2].is_set() and server.queued == 1  # two in flight at most
        gated.release(0)
        await gated.entered[2].wait()
        gated.release(1)
        got = [await first, await second, await third]
    assert [s.batch_id for s in got] == [0, 1, 2]


async def test_without_prefetch_one_batch_is_in_flight(engine: Engine) -> None:
    gated = GatedEngine(engine, gated=[0])
    async with Server(gated, ServeConfig(max_batch_requests=1)) as server:
        assert not server.prefetch_active
        first = asyncio.create_task(server.submit(prompt(40, 0)))
        await gated.entered[0].wait()
        second = server.submit_nowait(prompt(40, 1))
        for _ in range(50):
            await asyncio.sleep(0)
        assert not gated.entered[1].is_set() and server.queued == 1
        gated.release(0)
        await first
        assert (await second).batch_id == 1


def test_config_is_validated() -> None:
    with pytest.raises(ValueError, match="max_batch_tokens must be at least 1"):
        ServeConfig(max_batch_tokens=0)
    with pytest.raises(ValueError, match="max_prompt_tokens must be None or an integer"):
        ServeConfig(max_prompt_tokens=0)


async def _cold(model: HybridModel, prompts: list[np.ndarray]) -> list[PrefillResult]:
    out = []
    for p in prompts:  # a fresh engine per prompt: nothing cached anywhere
        async with Engine(model, EngineConfig(store="memory", offload=False,
                                              pool_bytes=16 << 20)) as cold:
            out.extend(await cold.prefill([p]))
    return out


async def _serve_all(server: Server, prompts: list[np.ndarray]) -> list[PrefillResult]:
    served = await asyncio.gather(*(server.submit(p) for p in prompts))
    return [s.result for s in served]


@pytest.mark.parametrize("prefetch", [False, True])
async def test_results_are_exact_against_a_cold_engine(tiny_model: HybridModel,
                                                       prefetch: bool) -> None:
    prompts = [prompt(150 + 17 * i, i, shared=96) for i in range(6)]
    cfg = EngineConfig(store="memory", pool_bytes=16 << 20)
    serve = ServeConfig(max_batch_tokens=400, prefetch=prefetch)
    async with Engine(tiny_model, cfg) as eng, Server(eng, serve) as s:
        first = await _serve_all(s, prompts[:3])
        await eng.wait_offloads()
        eng.drop_device_cache()  # the rest restores the shared prefix from the store
        second = await _serve_all(s, prompts[3:])
    got = first + second
    assert sum(r.restored_tokens for r in second) > 0
    for ref, res in zip(await _cold(tiny_model, prompts), got, strict=True):
        assert kl_divergence(ref.next_token_logprobs, res.next_token_logprobs) <= KL_EXACT


@pytest.mark.mooncake
async def test_real_mooncake_restores_through_the_server(
        mc_client: MooncakeStore, tiny_model: HybridModel, namespace: str) -> None:
    prompts = [prompt(200 + 9 * i, 10 + i, shared=128) for i in range(4)]
    cfg = EngineConfig(store="embedded", namespace=namespace, pool_bytes=16 << 20)
    async with Engine(tiny_model, cfg, store=mc_client) as eng, Server(eng) as server:
        await server.submit(prompts[0])
        report = await eng.wait_offloads()
        assert report.ok and report.objects > 0
        eng.drop_device_cache()
        got = await _serve_all(server, prompts[1:])
    assert all(r.restored_tokens == 128 for r in got)
    for ref, res in zip(await _cold(tiny_model, prompts[1:]), got, strict=True):
        assert kl_divergence(ref.next_token_logprobs, res.next_token_logprobs) <= KL_EXACT


async def test_cancelled_submits_free_their_slots_and_wake_a_blocked_submit(
        engine: Engine) -> None:
    """Both queued ``submit`` calls cancelled while the queue is full: they
    leave the queue at once (``queued`` drops, ``submit_nowait`` is taken
    again) and a ``submit`` blocked for room is woken, before any batch
    ends (before: ``queued`` stayed 2 and the blocked submit waited for an
    unrelated ``submit_nowait``)."""
    gated = GatedEngine(engine, gated=[0])
    async with Server(gated, ServeConfig(max_queue=2, max_batch_requests=1)) as server:
        first = asyncio.create_task(server.submit(prompt(40, 0)))
        await gated.entered[0].wait()
        queued = [asyncio.create_task(server.submit(prompt(40, i))) for i in (1, 2)]
        await yield_until(lambda: server.queued == 2)
        blocked = asyncio.create_task(server.submit(prompt(40, 3)))
        for task in queued:
            task.cancel()
        await yield_until(lambda: server.queued == 1)  # the blocked one took a slot
        assert not blocked.done()
        also = server.submit_nowait(prompt(40, 4))
        assert server.queued == 2
        gated.release(0)
        await first
        assert (await blocked).batch_id == 1 and (await also).batch_id == 2
        for task in queued:
            assert task.cancelled()
    assert gated.batches == [[40], [40], [40]]
