"""The simulated model: it runs the real engine (restores, device hits,
checkpoints) with exact results, it notices a skipped layer wait, and its
forward spends the compute model's time per layer."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Sequence

import anyio
import numpy as np
import pytest
import torch

from layerlift.engine.api import Engine
from layerlift.engine.config import EngineConfig
from layerlift.engine.model.api import ForwardRequest
from layerlift.engine.model.architectures import simulated_spec
from layerlift.engine.model.compute_model import FittedCompute, KindFit, SeqWork
from layerlift.engine.model.simulated import SimulatedModel
from layerlift.engine.results import PrefillResult
from layerlift.linker.memory_store import MemoryStore
from layerlift.pools import UnifiedKVPool
from layerlift.pools.spec import Component, ModelSpec
from layerlift.testing import KL_EXACT, KL_WRONG, FaultyStore, SkipLayerWaits, kl_divergence

FAST = FittedCompute("fast", {c: KindFit(0.0, 0.0) for c in Component}, window=64)


def prompts(lengths: Sequence[int], seed: int, vocab: int = 512) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, vocab, n, dtype=np.int64) for n in lengths]


def kls(a: Sequence[PrefillResult], b: Sequence[PrefillResult]) -> list[float]:
    return [kl_divergence(x.next_token_logprobs, y.next_token_logprobs)
            for x, y in zip(a, b, strict=True)]


async def cold(model: SimulatedModel, batch: list[np.ndarray]) -> list[PrefillResult]:
    async with Engine(model, EngineConfig(store="memory", offload=False,
                                          pool_bytes=64 << 20)) as eng:
        return await eng.prefill(batch)


@pytest.mark.parametrize("spec", [
    ModelSpec.preset("tiny"),
    simulated_spec("qwen3-next-80b-a3b", token_scale=64, page_size=16, track_interval=32),
    simulated_spec("gpt-oss-20b", token_scale=32, page_size=4, track_interval=16),
], ids=["tiny", "qwen3-next", "gpt-oss"])
async def test_restores_and_device_hits_are_exact(spec: ModelSpec) -> None:
    model = SimulatedModel(spec, FAST, token_scale=1)
    base = prompts([300], seed=1)[0]
    batch = [base, np.concatenate([base[:200], prompts([90], seed=2)[0]])]
    want = await cold(model, batch)
    store = MemoryStore()
    cfg = EngineConfig(store="memory", pool_bytes=128 << 20)
    async with Engine(model, cfg, store=store) as eng:
        first = await eng.prefill(batch)
        assert max(kls(first, want)) <= KL_EXACT
        again = await eng.prefill(batch)  # device hits, checkpoints as COW sources
        assert all(r.device_hit_tokens > 0 for r in again)
        await eng.wait_offloads()
        eng.drop_device_cache()
        eng.pool.buffer.zero_()  # stale bytes cannot fake a restore
        restored = await eng.prefill(batch)
    assert all(r.restored_tokens > 0 for r in restored)
    assert max(kls(again, want)) <= KL_EXACT
    assert max(kls(restored, want)) <= KL_EXACT


async def test_a_skipped_layer_wait_is_noticed() -> None:
    """Negative control: without the per-layer waits the simulated forward
    reads stamps that have not landed and its output changes."""
    spec = ModelSpec.preset("tiny")
    inner = SimulatedModel(spec, FAST)
    model = SkipLayerWaits(inner)
    batch = prompts([300, 260], seed=3)
    store = FaultyStore(MemoryStore(), spec)
    async with Engine(model, EngineConfig(store="memory", pool_bytes=32 << 20),
                      store=store) as eng:
        r1 = await eng.prefill(batch)
        await eng.wait_offloads()
        eng.drop_device_cache()
        eng.pool.buffer.zero_()
        gate = threading.Event()
        fault = store.gate_layer(0, gate)
        model.enabled = True
        task = asyncio.create_task(eng.prefill(batch))
        try:
            assert await anyio.to_thread.run_sync(model.forward_done.wait, 60.0)
            assert not gate.is_set()
        finally:
            gate.set()
        r2 = await task
        model.enabled = False
    assert fault.started.is_set() and all(r.restored_tokens > 0 for r in r2)
    assert max(kls(r1, r2)) > KL_WRONG, "skipping the layer waits went unnoticed"


class FakeClock:
    """A clock that moves only when slept on (or told to)."""

    def __init__(self) -> None:
        self.now = 0.0
        self.slept: list[float] = []

    def __call__(self) -> float:
        return self.now

    def sleep(self, s: float) -> None:
        self.slept.append(s)
        self.now += s + 1e-3  # every sleep overshoots by 1 ms


def one_request(spec: ModelSpec, n: int) -> tuple[ForwardRequest, UnifiedKVPool]:
    pool = UnifiedKVPool(spec, 8 << 20)
    pages = -(-n // spec.page_size)
    got = pool.alloc_many({Component.FULL: pages, Component.SWA: pages, Component.MAMBA: 1})
    assert got is not None
    idx = got
    req = ForwardRequest(tokens=torch.arange(n, dtype=torch.int64) % 500, prefix_len=0,
                         full_pages=idx[Component.FULL], swa_pages=idx[Component.SWA],
                         mamba_slot=int(idx[Component.MAMBA][0]))
    return req, pool


def test_each_layer_takes_the_modeled_time_and_overshoot_does_not_add_up() -> None:
    spec = ModelSpec.preset("tiny")
    fit = FittedCompute("t", {Component.FULL: KindFit(0.010, 0.0, 0.0),
                              Component.SWA: KindFit(0.020, 0.0, 0.0),
                              Component.MAMBA: KindFit(0.0, 0.001)}, window=64)
    clock = FakeClock()
    model = SimulatedModel(spec, fit, token_scale=4, clock=clock, sleep=clock.sleep)
    req, pool = one_request(spec, 40)
    want = fit.layer_seconds(spec.kinds, [SeqWork(0, 160)])  # 40 tokens * scale 4
    assert model.layer_seconds([req]) == want
    waited = {2: 0.5}  # layer 2's restore lands 0.5 s late

    def before(layer: int) -> None:
        clock.now += waited.get(layer, 0.0)

    model.forward_batch([req], pool, before, None)
    # Each layer sleeps its time minus the previous sleep's 1 ms overshoot;
    # the wait before layer 2 restarts the schedule.
    assert clock.slept[0] == pytest.approx(want[0])
    for layer in range(1, spec.num_layers):
        lag = 0.0 if layer == 2 else 1e-3
        assert clock.slept[layer] == pytest.approx(want[layer] - lag)
    assert clock.now == pytest.approx(sum(want) + 0.5 + 1e-3 * 2)
    assert model.modeled_s == pytest.approx(sum(want))


def test_per_token_logprobs_are_refused() -> None:
    spec = ModelSpec.preset("tiny")
    req, pool = one_request(spec, 20)
    req.want_token_logprobs = True
    with pytest.raises(ValueError, match="per-token"):
        SimulatedModel(spec, FAST).forward_batch([req], pool)
    with pytest.raises(ValueError, match="token_scale"):
        SimulatedModel(spec, FAST, token_scale=0)


def _forward(model: SimulatedModel, pool: UnifiedKVPool, req: ForwardRequest) -> int:
    out = model.forward_batch([req], pool)
    return int(out.next_token_logprobs[0].argmax())


def _requests(spec: ModelSpec, n: int, prefix: int
              ) -> tuple[UnifiedKVPool, ForwardRequest, ForwardRequest, ForwardRequest]:
    """A cold forward of ``n`` tokens, the one of its first ``prefix``
    tokens, and the request that continues that one from the same pages and
    state slot."""
    cold, pool = one_request(spec, n)
    head = ForwardRequest(tokens=cold.tokens[:prefix], prefix_len=0,
                          full_pages=cold.full_pages, swa_pages=cold.swa_pages,
                          mamba_slot=cold.mamba_slot)
    tail = ForwardRequest(tokens=cold.tokens[prefix:], prefix_len=prefix,
                          full_pages=cold.full_pages, swa_pages=cold.swa_pages,
                          mamba_slot=cold.mamba_slot)
    return pool, cold, head, tail


def test_every_read_page_and_state_element_counts() -> None:
    """A continuation from intact pages answers like the cold run; one
    element damaged in a middle prefix page (not the last one), or the last
    element of a state tensor, changes the answer."""
    spec = ModelSpec.preset("tiny")
    model = SimulatedModel(spec, FAST)
    pool, cold, head, tail = _requests(spec, 96, 64)
    want = _forward(model, pool, cold)
    _forward(model, pool, head)
    assert _forward(model, pool, tail) == want
    _forward(model, pool, head)
    k, _ = pool.kv_view(0)  # layer 0 is FULL
    k[int(cold.full_pages[1]), 3, 0, 5] += 7  # page 1 of the prefix's 4
    assert _forward(model, pool, tail) != want
    _forward(model, pool, head)
    mamba = next(i for i, c in enumerate(spec.kinds) if c is Component.MAMBA)
    pool.mamba_view(mamba)[-1][cold.mamba_slot].view(-1)[-1] += 3
    assert _forward(model, pool, tail) != want


def test_the_forward_clock_is_split_into_gpu_wait_and_host_time() -> None:
    spec = ModelSpec.preset("tiny")
    fit = FittedCompute("t", {c: KindFit(0.010, 0.0) for c in Component}, window=64)
    clock = FakeClock()
    model = SimulatedModel(spec, fit, clock=clock, sleep=clock.sleep)
    req, pool = one_request(spec, 40)

    def before(layer: int) -> None:
        clock.now += 0.5 if layer == 2 else 0.0

    model.forward_batch([req], pool, before, None)
    split = model.clock_split()
    assert split["modeled_s"] == pytest.approx(0.010 * spec.num_layers)
    assert split["waited_s"] == pytest.approx(0.5)
    assert split["host_s"] == pytest.approx(2e-3)  # the two overshoots that did not overlap
    assert split["forwards"] == 1
