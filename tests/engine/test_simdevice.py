"""The engine's CUDA code path (the CUDA lane, pinned staging, the scatter,
per-layer events, the offloader's device copy) on the simulated device, where
streams really run late: restores are exact against cold runs with several
delay seeds, the fault table holds, and every negative control is caught.

Nothing here is a copy of the GPU path: the engine runs as on a GPU, with
``layerlift.testing.simdevice.SimDevice`` injected as its device seam."""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Iterator

import numpy as np
import pytest
import test_faults
from device_scenarios import (
    Rig,
    duplicates_trimmed_at_commit,
    events_on_wrong_stream,
    failed_layer_is_recomputed,
    relocations_before_restore,
    restore_equals_cold,
    skipped_waits,
)

from layerlift import Engine, EngineConfig, HybridModel
from layerlift.engine.loads import BatchLoad
from layerlift.engine.results import PrefillResult
from layerlift.linker.memory_store import MemoryStore
from layerlift.overlap.base import LayerJob
from layerlift.testing import KL_EXACT, KL_WRONG
from layerlift.testing.simdevice import SimDevice

SEEDS = (0, 1, 2)


def sim_rig(sim: SimDevice) -> Rig:
    return Rig("cpu", "cpu", sim, sim.synchronize)


@pytest.fixture(params=SEEDS, ids=[f"seed{s}" for s in SEEDS])
def sim(request: pytest.FixtureRequest) -> Iterator[SimDevice]:
    device = SimDevice(seed=request.param)
    yield device
    device.close()


# ---- exact restores ----------------------------------------------------------------------
@pytest.mark.parametrize("policy", ["overlap", "barrier"])
async def test_restore_equals_cold(sim: SimDevice, policy: str) -> None:
    await restore_equals_cold(sim_rig(sim), policy)


async def test_failed_layer_is_recomputed(sim: SimDevice) -> None:
    await failed_layer_is_recomputed(sim_rig(sim))


async def test_duplicates_trimmed_at_commit_restore_exactly(sim: SimDevice) -> None:
    assert max(await duplicates_trimmed_at_commit(sim_rig(sim))) <= KL_EXACT


async def test_relocations_before_a_restore_stay_exact() -> None:
    """PREPARE relocates pages of the float band (copies on the caller's
    stream) before the restore's load; the lane's fence orders the load after
    them. The relocation copies run late here (50 ms)."""
    sim = SimDevice(seed=0, relocation_delay_s=0.05)
    try:
        relocated, kls = await relocations_before_restore(sim_rig(sim))
    finally:
        sim.close()
    assert relocated >= 2, "no pool size made the restore relocate pages: the test lost its point"
    assert max(kls) <= KL_EXACT, kls
    assert sim.relocation_hazards == 0


# ---- negative controls: each must be caught --------------------------------------------
async def test_control_skipped_waits_is_caught(sim: SimDevice) -> None:
    kls = await skipped_waits(sim_rig(sim))
    assert max(kls) > KL_WRONG, "skipping the per-layer waits went unnoticed"


async def test_control_events_on_the_wrong_stream_is_caught(sim: SimDevice) -> None:
    kls = await events_on_wrong_stream(sim_rig(sim), sim.hold)
    assert max(kls) > KL_WRONG, "events recorded on the wrong stream went unnoticed"


async def test_control_unfenced_loads_is_caught() -> None:
    # The relocation copies run 200 ms late: a load not ordered after them overtakes them.
    sim = SimDevice(seed=0, relocation_delay_s=0.2)
    try:
        relocated, kls = await relocations_before_restore(sim_rig(sim), unfenced=True)
    finally:
        sim.close()
    assert relocated >= 2
    assert sim.relocation_hazards > 0, "no load overtook a relocation copy"
    assert max(kls) > KL_WRONG, "loads not fenced after the relocation copies went unnoticed"


def _stale_refresh(self: BatchLoad, jobs: list[LayerJob]) -> None:
    """``BatchLoad.refresh`` before issue 16's fix: fetch, nbytes and requests
    rebuilt, the device copy plan (``h2d``) kept from before COMMIT."""
    for job in jobs:
        fresh = self._whole_job() if self.whole else self._job(job.layer)
        job.fetch, job.nbytes, job.requests = fresh.fetch, fresh.nbytes, fresh.requests


async def test_control_stale_copy_plan_is_caught(sim: SimDevice,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(BatchLoad, "refresh", _stale_refresh)
    kls = await duplicates_trimmed_at_commit(sim_rig(sim))
    assert kls[0] <= KL_EXACT  # the batch that committed first is fine
    assert kls[1] > KL_WRONG, "a stale copy plan after COMMIT's trim went unnoticed"


# ---- the fault table (tests/engine/test_faults.py) on the simulated device --------------
@pytest.fixture(scope="module")
def fault_model() -> HybridModel:
    return test_faults.HybridModel(test_faults.ModelSpec.preset("tiny"), seed=0)


@pytest.fixture(scope="module")
def fault_batch(fault_model: HybridModel) -> list[np.ndarray]:
    rng = np.random.default_rng(42)
    return [rng.integers(0, fault_model.vocab_size, n, dtype=np.int64) for n in (300, 260)]


@pytest.fixture(scope="module")
def fault_cold(fault_model: HybridModel, fault_batch: list[np.ndarray]) -> list[PrefillResult]:
    async def run() -> list[PrefillResult]:
        cfg = EngineConfig(store="memory", offload=False, pool_bytes=16 << 20)
        async with Engine(fault_model, cfg) as engine:
            return await engine.prefill(fault_batch)

    return asyncio.run(run())


# Every fault point and call order; cancellations as anyio delivers them (the
# "held" and "timeout" deliveries test thread ownership, which does not depend
# on the device: they run in test_faults, and doubling them here would double
# this file's time).
SIM_CASES = [(o, f) for o, f in test_faults.CASES if f.how in (None, "anyio")]


@pytest.mark.parametrize(("order", "fault"), SIM_CASES,
                         ids=[f"{o}-{f.name}" for o, f in SIM_CASES])
async def test_fault_table(order: str, fault: test_faults.Fault, fault_model: HybridModel,
                           fault_batch: list[np.ndarray], fault_cold: list[PrefillResult],
                           monkeypatch: pytest.MonkeyPatch) -> None:
    """The same cases, checks and invariants as ``test_faults``, with the
    engine on the simulated device (a different delay seed per case)."""
    seed = test_faults.CASES.index((order, fault))
    device = SimDevice(seed=seed)
    monkeypatch.setattr(test_faults, "Engine", functools.partial(Engine, device=device))
    try:
        await test_faults.run_case(order, fault, MemoryStore(), fault_model, fault_batch,
                                   fault_cold)
    finally:
        device.close()
