"""Scenarios of the engine's device path, shared by the simulated-device tests
(``test_simdevice*.py``, CI) and the real GPU tests (``test_engine_gpu.py``).

A :class:`Rig` says where the model and the pool live: on a real GPU
(``cuda``, the engine builds its ``CudaDevice``) or on a simulated device
injected into the engine (``layerlift.testing.simdevice.SimDevice``). Every
scenario compares with cold runs of the same prompts through the one KL helper
and zeroes the pool between offload and restore, so a missing copy, wait or
fence cannot pass by finding the old bytes in place.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from layerlift import Engine, EngineConfig, EngineError, HybridModel, ModelSpec
from layerlift.engine.results import PrefillResult
from layerlift.linker.memory_store import MemoryStore
from layerlift.linker.store_base import Store
from layerlift.overlap.device import Device
from layerlift.testing import (
    KL_EXACT,
    FaultyStore,
    SkipLayerWaits,
    assert_quiescent,
    kl_divergence,
    offload_and_drop,
)

WAIT_S = 30.0


@dataclass
class Rig:
    """Where a scenario runs: ``where`` is the model's (and the pool's) torch
    device, ``device`` the seam injected into the engine (None: the engine
    builds the one ``cfg_device`` names), ``sync`` blocks until the device
    ran everything issued. ``deterministic`` builds the reference model in
    its float64 mode (a GPU's float32 kernels may round differently with the
    batch shape; cold runs are single prompts, restores are batches)."""

    where: str
    cfg_device: str
    device: Device | None
    sync: Callable[[], None]
    deterministic: bool = False

    def engine(self, model: Any, store: Store, **cfg: Any) -> Engine:
        cfg.setdefault("pool_bytes", 32 << 20)
        config = EngineConfig(store="memory", device=self.cfg_device,
                              layer_wait_timeout_s=WAIT_S, **cfg)
        return Engine(model, config, store=store, device=self.device)

    async def drop(self, engine: Engine) -> None:
        """Offload everything, empty the device cache, zero the pool."""
        await engine.wait_offloads()
        self.sync()
        await offload_and_drop(engine)
        self.sync()


def model_on(rig: Rig, seed: int = 0) -> HybridModel:
    return HybridModel(ModelSpec.preset("tiny"), seed=seed, device=rig.where,
                       deterministic=rig.deterministic)


def prompts(spec: ModelSpec, n: int, seed: int, length: int = 300) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, spec.dims.vocab_size, length).tolist() for _ in range(n)]


def kls(ref: Sequence[PrefillResult], got: Sequence[PrefillResult]) -> list[float]:
    return [kl_divergence(a.next_token_logprobs, b.next_token_logprobs)
            for a, b in zip(ref, got, strict=True)]


async def cold_runs(rig: Rig, model: Any, batch: Sequence[Sequence[int]]) -> list[PrefillResult]:
    """Each prompt computed alone, nothing restored (the reference)."""
    async with rig.engine(model, MemoryStore(), offload=False) as engine:
        return [(await engine.prefill([p]))[0] for p in batch]


# ---- scenarios ---------------------------------------------------------------------------
async def restore_equals_cold(rig: Rig, policy: str) -> None:
    """Offload, zero the pool, restore: exact, and the engine is quiescent."""
    model = model_on(rig)
    batch = prompts(model.spec, 3, seed=1)
    cold = await cold_runs(rig, model, batch)
    async with rig.engine(model, MemoryStore(), policy=policy) as engine:
        first = await engine.prefill(batch)
        assert max(kls(cold, first)) <= KL_EXACT
        await rig.drop(engine)
        again = await engine.prefill(batch)
        assert all(r.restored_tokens == 256 for r in again), [r.restored_tokens for r in again]
        assert max(kls(cold, again)) <= KL_EXACT, kls(cold, again)
        await engine.wait_offloads()
        assert_quiescent(engine)


async def failed_layer_is_recomputed(rig: Rig) -> None:
    model = model_on(rig)
    batch = prompts(model.spec, 1, seed=2)
    store = FaultyStore(MemoryStore(), model.spec)
    async with rig.engine(model, store) as engine:
        first = await engine.prefill(batch)
        await rig.drop(engine)
        store.fail_layer(3)
        again = await engine.prefill(batch)
        assert again[0].recomputed_after_failure
        assert max(kls(first, again)) <= KL_EXACT
        await engine.wait_offloads()
        assert_quiescent(engine)


async def skipped_waits(rig: Rig) -> list[float]:
    """The forward skips its per-layer waits while layer 0's read is held
    until the forward returned: returns the KLs against the cold runs."""
    inner = model_on(rig)
    model = SkipLayerWaits(inner)
    batch = prompts(inner.spec, 2, seed=3)
    cold = await cold_runs(rig, inner, batch)
    store = FaultyStore(MemoryStore(), inner.spec)
    async with rig.engine(model, store) as engine:
        await engine.prefill(batch)
        await rig.drop(engine)
        gate = threading.Event()
        store.gate_layer(0, gate)
        model.enabled = True
        task = asyncio.create_task(engine.prefill(batch))
        try:
            assert await asyncio.to_thread(model.forward_done.wait, WAIT_S)
        finally:
            gate.set()
        again = await task
        assert all(r.restored_tokens > 0 for r in again)
        await engine.wait_offloads()
        return kls(cold, again)


def dedup_prompts(spec: ModelSpec, seed: int) -> tuple[list[int], list[int]]:
    """``a`` = X + its own tail, ``b`` = X + Y + its own tail: both restore X
    (8 pages), ``b`` also Y (8 more)."""
    rng = np.random.default_rng(seed)
    x, y = (rng.integers(0, spec.dims.vocab_size, 128).tolist() for _ in range(2))
    a = x + rng.integers(0, spec.dims.vocab_size, 40).tolist()
    b = x + y + rng.integers(0, spec.dims.vocab_size, 40).tolist()
    return a, b


async def duplicates_trimmed_at_commit(rig: Rig, seed: int = 5) -> list[float]:
    """Two batches restore the same prefix X: ``a``'s lands, ``b`` looks up
    before ``a`` committed (so it plans X too), ``a`` commits and computes,
    then ``b`` commits while its later layers are not yet issued: COMMIT trims
    X from ``b``'s loads and ``refresh`` rebuilds them (fetch and copy plan).
    Returns the KLs of ``a`` and ``b`` against cold runs."""
    model = model_on(rig)
    a, b = dedup_prompts(model.spec, seed)
    cold = await cold_runs(rig, model, [a, b])
    store = FaultyStore(MemoryStore(), model.spec)
    async with rig.engine(model, store, max_in_flight=1) as engine:
        await engine.prefill([b])  # the store holds X + Y
        await rig.drop(engine)
        plan_a = await engine.lookup(a)
        load_a = await engine.load([plan_a])
        await load_a.readiness.ready(model.spec.num_layers - 1, timeout=WAIT_S)
        plan_b = await engine.lookup(b)
        assert plan_b.restore_tokens == 256, "b must plan to restore X and Y"
        gate = threading.Event()
        store.gate_layer(0, gate)  # b's later layers stay unissued (max_in_flight=1)
        # b's fetches start at once; its load returns once a's forward left the device
        loading_b = asyncio.create_task(engine.load([plan_b]))
        try:
            (got_a,) = await load_a.forward()
            load_b = await loading_b
            load_b.commit()
        finally:
            gate.set()
        (got_b,) = await load_b.forward()
        assert got_b.restored_tokens == 256
        await engine.wait_offloads()
        assert_quiescent(engine)
        return kls(cold, [got_a, got_b])


class Counter:
    """Counts calls (a pool move listener)."""

    def __init__(self) -> None:
        self.n = 0

    def count(self, *_: Any) -> None:
        self.n += 1


class ForwardWatch:
    """A model wrapper that sets ``done`` once a forward returned."""

    def __init__(self, model: Any) -> None:
        self.inner = model
        self.done = threading.Event()

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def forward_batch(self, requests: Any, pool: Any, before: Any, after: Any) -> Any:
        try:
            return self.inner.forward_batch(requests, pool, before, after)
        finally:
            self.done.set()


async def events_on_wrong_stream(rig: Rig, hold: Callable[[threading.Event], None]) -> list[float]:
    """The lane records its events on the worker's current stream instead of
    the load stream, while ``hold`` keeps the load stream's copies back until
    the forward returned. Returns the KLs against the cold runs."""
    from layerlift.testing.controls import WrongStreamEvents

    inner = model_on(rig)
    model = ForwardWatch(inner)
    batch = prompts(inner.spec, 2, seed=6)
    cold = await cold_runs(rig, inner, batch)
    async with rig.engine(model, MemoryStore()) as engine:
        await engine.prefill(batch)
        await rig.drop(engine)
        control = WrongStreamEvents(engine.lane)
        control.enabled = True
        model.done.clear()
        hold(model.done)
        again = await engine.prefill(batch)
        assert all(r.restored_tokens > 0 for r in again)
        await engine.wait_offloads()
        return kls(cold, again)


@dataclass
class StressStats:
    """What a stress run went through (so a test can check it covered its ground)."""

    results: int = 0
    restored: int = 0
    recomputed: int = 0
    faults: int = 0
    drops: int = 0
    worst_kl: float = 0.0
    wrong: int = 0
    refused: int = 0
    refusals: list[str] = field(default_factory=list)


async def stress(rig: Rig, seed: int, *, rounds: int = 10, pool_bytes: int = 1_000_000,
                 faults: bool = True, lane_control: Callable[[Any], Any] | None = None,
                 ) -> StressStats:
    """Random batches of prompts over a few shared roots, run as concurrent
    prefills (the next batch looks up and fetches while one computes), in a
    tight pool (evictions, relocations of the float band, duplicates trimmed
    at COMMIT when two batches restore the same prefix), with the device
    cache dropped now and then (restores) and layer reads failing now and
    then (recomputes). Every result is compared with a cold run; the count of
    inexact ones is returned, not asserted, so negative controls can use it.
    ``lane_control(lane)`` wraps the engine's lane (a negative control)."""
    model = model_on(rig)
    spec = model.spec
    vocab = spec.dims.vocab_size
    rng = np.random.default_rng(seed)
    roots = [rng.integers(0, vocab, int(rng.choice([64, 128, 192]))).tolist() for _ in range(3)]
    pool_prompts = [roots[int(rng.integers(0, 3))] + rng.integers(0, vocab, int(n)).tolist()
                    for n in rng.integers(20, 140, size=7)]
    cold = {tuple(p): r for p, r in zip(pool_prompts, await cold_runs(rig, model, pool_prompts),
                                        strict=True)}
    store = FaultyStore(MemoryStore(), spec)
    stats = StressStats()
    async with rig.engine(model, store, pool_bytes=pool_bytes,
                          max_in_flight=int(rng.integers(1, 9))) as engine:
        if lane_control is not None:
            lane_control(engine.lane)
        for _ in range(rounds):
            if rng.random() < 0.4:
                await rig.drop(engine)
                stats.drops += 1
            if faults and rng.random() < 0.25:
                store.fail_layer(int(rng.integers(0, spec.num_layers)))
                stats.faults += 1
            batches = [[pool_prompts[int(i)] for i in rng.integers(0, len(pool_prompts),
                                                                    int(rng.integers(1, 4)))]
                       for _ in range(int(rng.integers(1, 4)))]
            outs = await asyncio.gather(*(engine.prefill(b) for b in batches),
                                        return_exceptions=True)
            store.clear()
            for b, out in zip(batches, outs, strict=True):
                if isinstance(out, EngineError) and "fit" in str(out):
                    # The concurrent batches held the pool: a part (or its
                    # recompute) did not fit. A clear error, nothing to compare.
                    stats.refused += 1
                    stats.refusals.append(str(out))
                    continue
                if isinstance(out, BaseException):
                    raise out
                for p, r in zip(b, out, strict=True):
                    kl = kl_divergence(cold[tuple(p)].next_token_logprobs, r.next_token_logprobs)
                    stats.results += 1
                    stats.restored += r.restored_tokens > 0
                    stats.recomputed += r.recomputed_after_failure
                    stats.worst_kl = max(stats.worst_kl, kl)
                    stats.wrong += kl > KL_EXACT
        await engine.wait_offloads()
        assert_quiescent(engine)
    return stats


async def relocations_before_restore(rig: Rig, *, unfenced: bool = False,
                                     sizes: Sequence[int] = range(350_000, 480_001, 10_000),
                                     ) -> tuple[int, list[float]]:
    """Per pool size: ``b`` computed and offloaded, the device dropped; ``a``
    computed (cached); ``b`` restored, its PREPARE moving pages of the float
    band (relocation copies on the caller's stream) to make room; ``a`` again
    (a device hit on what was moved). ``unfenced`` drops the lane's fence
    (:class:`~layerlift.testing.controls.UnfencedLoads`). Returns how many
    sizes relocated during ``b``'s restore, and every KL against cold runs."""
    from layerlift.testing.controls import UnfencedLoads

    model = model_on(rig)
    a, b = prompts(model.spec, 2, seed=7, length=200)
    cold = await cold_runs(rig, model, [a, b])
    relocated, out = 0, []
    for size in sizes:
        async with rig.engine(model, MemoryStore(), pool_bytes=size) as engine:
            moves = Counter()
            engine.pool.add_move_listener(moves.count)
            UnfencedLoads(engine.lane).enabled = unfenced
            await engine.prefill([b])
            await rig.drop(engine)
            await engine.prefill([a])
            await engine.wait_offloads()
            before = moves.n
            got_b = await engine.prefill([b])
            relocated += moves.n > before
            got_a = await engine.prefill([a])
            out += kls(cold, got_a + got_b)
            await engine.wait_offloads()
            assert_quiescent(engine)
    return relocated, out
