"""The CUDA path end to end on a real GPU: pool in device memory, fetches
landing in pinned staging, H2D on the load stream, per-layer events waited on
the forward's stream. The same scenarios run in CI on the simulated device
(``test_simdevice*.py``); here they run wherever a GPU is present and are
skipped with a reason elsewhere (``bench/gpu_check.sh`` runs them).

Between offload and restore the (empty) pool is zeroed, so a missing copy
or a missing wait cannot pass by finding the old bytes in the same slots.
The negative controls that are deterministic on a GPU (skipped waits with
layer 0's read held back; a stale copy plan after COMMIT trimmed duplicates)
must come out wrong; the two that need streams held back on cue (events on
the wrong stream, unfenced loads) run on the simulated device only."""

from __future__ import annotations

import pytest
import torch
from device_scenarios import (
    Rig,
    duplicates_trimmed_at_commit,
    failed_layer_is_recomputed,
    prompts,
    relocations_before_restore,
    restore_equals_cold,
    skipped_waits,
    stress,
)

from layerlift import Engine, EngineConfig, HybridModel, ModelSpec
from layerlift.engine.loads import BatchLoad
from layerlift.linker.memory_store import MemoryStore
from layerlift.overlap.base import LayerJob
from layerlift.testing import KL_EXACT, KL_WRONG, kl_divergence, offload_and_drop

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device on this machine"),
]


def cuda_rig() -> Rig:
    return Rig("cuda", "cuda", None, torch.cuda.synchronize, deterministic=True)


@pytest.mark.parametrize("policy", ["overlap", "barrier"])
async def test_cuda_restore_equals_cold(policy: str) -> None:
    await restore_equals_cold(cuda_rig(), policy)


async def test_cuda_failed_layer_is_recomputed() -> None:
    await failed_layer_is_recomputed(cuda_rig())


async def test_cuda_duplicates_trimmed_at_commit_restore_exactly() -> None:
    assert max(await duplicates_trimmed_at_commit(cuda_rig())) <= KL_EXACT


async def test_cuda_relocations_before_a_restore_stay_exact() -> None:
    relocated, kls = await relocations_before_restore(cuda_rig())
    assert relocated >= 1
    assert max(kls) <= KL_EXACT, kls


@pytest.mark.parametrize("seed", [0, 1, 2])
async def test_cuda_stress_exact(seed: int) -> None:
    stats = await stress(cuda_rig(), seed)
    assert stats.wrong == 0 and stats.worst_kl <= KL_EXACT, stats


async def test_cuda_skipped_waits_break_results() -> None:
    """Negative control: layer 0's fetch is held until the forward returned;
    without the per-layer waits the forward reads zeroed pages."""
    kls = await skipped_waits(cuda_rig())
    assert max(kls) > KL_WRONG, "skipping the layer waits went unnoticed on CUDA"


def _stale_refresh(self: BatchLoad, jobs: list[LayerJob]) -> None:
    """``BatchLoad.refresh`` before issue 16's fix: the copy plan kept."""
    for job in jobs:
        fresh = self._whole_job() if self.whole else self._job(job.layer)
        job.fetch, job.nbytes, job.requests = fresh.fetch, fresh.nbytes, fresh.requests


async def test_cuda_stale_copy_plan_breaks_results(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(BatchLoad, "refresh", _stale_refresh)
    kls = await duplicates_trimmed_at_commit(cuda_rig())
    assert kls[1] > KL_WRONG, "a stale copy plan went unnoticed on CUDA"


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs a second CUDA device")
async def test_cuda_restore_on_a_second_device() -> None:
    """The forward thread runs under the pool's device and waits on that
    device's stream (a fresh thread's current device is cuda:0)."""
    spec = ModelSpec.preset("tiny")
    model = HybridModel(spec, seed=0, device="cuda:1")
    batch = prompts(spec, 2, seed=4)
    cfg = EngineConfig(store="memory", device="cuda:1", pool_bytes=32 << 20)
    async with Engine(model, cfg, store=MemoryStore()) as engine:
        first = await engine.prefill(batch)
        await offload_and_drop(engine)
        again = await engine.prefill(batch)
        for a, b in zip(first, again, strict=True):
            assert b.restored_tokens > 0
            assert kl_divergence(a.next_token_logprobs, b.next_token_logprobs) <= KL_EXACT
