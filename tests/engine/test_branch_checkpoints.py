"""Branch-point checkpoints, end to end (a real Mooncake master for the device path).

Three prompts share 700 tokens (track interval 512, page 16). Without
branch checkpoints the third restores 512 tokens (the last grid boundary);
with them the second captures the recurrent state at page 43 (688 tokens)
where it leaves the first, and the third starts from there. The second's
offload sends only what the store lacks: the branch checkpoint and the SWA
window before it, never the shared KV again. Every result equals a cold run.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence

import numpy as np
import pytest
import torch

from layerlift import Engine, EngineConfig, HybridModel, ModelSpec, PrefillResult
from layerlift.engine.compute import alloc_compute, branch_page, compute_bytes
from layerlift.engine.plan import LookupPlan
from layerlift.linker.mooncake_store import MooncakeStore
from layerlift.linker.store_base import Store
from layerlift.pools import Component, UnifiedKVPool
from layerlift.pools.tree import UnifiedRadixTree
from layerlift.testing import KL_EXACT, kl_divergence

SPEC = ModelSpec.preset("tiny", track_interval=512)
SHARED, TOTAL = 700, 800
BRANCH_TOKENS = SHARED // SPEC.page_size * SPEC.page_size  # 688


class PutLog:
    """Forwards to a real store and records the key of every put."""

    def __init__(self, inner: Store) -> None:
        self.inner = inner
        self._lock = threading.Lock()
        self.keys: list[str] = []

    def put(self, keys: Sequence[str], ptrs: Sequence[int], sizes: Sequence[int]) -> None:
        self.inner.put(keys, ptrs, sizes)
        with self._lock:
            self.keys.extend(keys)

    def put_parts(self, keys: Sequence[str], ptrs: Sequence[Sequence[int]],
                  sizes: Sequence[Sequence[int]]) -> None:
        self.inner.put_parts(keys, ptrs, sizes)
        with self._lock:
            self.keys.extend(keys)

    def take(self) -> dict[str, int]:
        """Puts per component since the last call."""
        with self._lock:
            keys, self.keys = self.keys, []
        out = {"full": 0, "swa": 0, "mamba": 0}
        for k in keys:
            out[k.split("/")[-3]] += 1
        return out

    def __getattr__(self, name: str) -> object:
        return getattr(self.inner, name)


@pytest.fixture(scope="module")
def model() -> HybridModel:
    return HybridModel(SPEC, seed=0)


def prompts() -> list[np.ndarray]:
    rng = np.random.default_rng(7)
    shared = rng.integers(0, SPEC.dims.vocab_size, SHARED)
    return [np.concatenate([shared, rng.integers(0, SPEC.dims.vocab_size, TOTAL - SHARED)])
            for _ in range(3)]


async def cold(model: HybridModel, ps: list[np.ndarray]) -> list[PrefillResult]:
    out = []
    for p in ps:
        async with Engine(model, EngineConfig(store="memory", offload=False,
                                              pool_bytes=16 << 20)) as eng:
            out.extend(await eng.prefill([p]))
    return out


def assert_exact(ref: list[PrefillResult], got: list[PrefillResult]) -> None:
    for r, g in zip(ref, got, strict=True):
        assert kl_divergence(r.next_token_logprobs, g.next_token_logprobs) <= KL_EXACT


@pytest.mark.mooncake
@pytest.mark.parametrize("branches", [True, False])
async def test_third_prompt_starts_at_the_branch_page(
        mc_client: MooncakeStore, model: HybridModel, namespace: str, branches: bool) -> None:
    store = PutLog(mc_client)
    cfg = EngineConfig(store="embedded", namespace=namespace, pool_bytes=16 << 20,
                       branch_checkpoints=branches)
    a, b, c = prompts()
    async with Engine(model, cfg, store=store) as eng:  # type: ignore[arg-type]
        (ra,) = await eng.prefill([a])
        await eng.wait_offloads()
        store.take()
        (rb,) = await eng.prefill([b])
        report = await eng.wait_offloads()
        sent_b = store.take()
        (rc,) = await eng.prefill([c])
        eng.tree.check_integrity()
        eng.pool.verify_byte_accounting()
    assert report.ok and eng.tree.branch_checkpoints is branches
    assert rb.device_hit_tokens == 512
    if branches:
        assert rc.device_hit_tokens == BRANCH_TOKENS
        assert eng.tree.branch_checkpoint_count() == 1
        # b's own pages [43, 50), the branch checkpoint, the SWA window before it.
        window = SPEC.swa_window // SPEC.page_size
        assert sent_b == {"full": TOTAL // 16 - 43, "swa": window, "mamba": 1}
    else:  # the negative control: the grid boundary only
        assert rc.device_hit_tokens == 512
        assert sent_b == {"full": TOTAL // 16 - 43, "swa": 0, "mamba": 0}
    assert_exact(await cold(model, [a, b, c]), [ra, rb, rc])


async def test_third_prompt_restores_the_branch_from_the_store(model: HybridModel) -> None:
    cfg = EngineConfig(store="memory", pool_bytes=16 << 20)
    a, b, c = prompts()
    async with Engine(model, cfg) as eng:
        got = [*(await eng.prefill([a])), *(await eng.prefill([b]))]
        await eng.wait_offloads()
        eng.drop_device_cache()
        got += await eng.prefill([c])
    assert_exact(await cold(model, [a, b, c]), got)
    assert got[2].restored_tokens == BRANCH_TOKENS


def test_branch_page_and_what_the_forward_allocates_for_it() -> None:
    pool = UnifiedKVPool(SPEC, 16 << 20)
    tree = UnifiedRadixTree(SPEC, pool)
    a, b, _ = prompts()
    n = len(a) // SPEC.page_size  # 50 pages: grid checkpoint at 32 only
    full, swa = pool.alloc(Component.FULL, n), pool.alloc(Component.SWA, n)
    slot = int(pool.alloc(Component.MAMBA, 1)[0])
    tree.insert(a, full, swa, torch.ones(n, dtype=torch.bool), {32: slot})
    match = tree.match_prefix(b)
    plan = LookupPlan(0, b, (), match, SPEC, boundary=match.boundary_pages)
    assert (match.boundary_pages, match.kv_pages, branch_page(plan)) == (32, 43, 43)
    got = alloc_compute(pool, tree, plan)
    assert got is not None and sorted(got.capture) == [43]
    slot_bytes = SPEC.page_bytes(Component.MAMBA)
    tree.branch_checkpoints = False
    off = alloc_compute(pool, tree, plan)
    assert off is not None and off.capture == {}
    assert compute_bytes(pool, plan) == sum(
        len(idx) * pool.page_bytes(c) for c, idx in got.demand().items())
    assert compute_bytes(pool, plan) - slot_bytes == sum(
        len(idx) * pool.page_bytes(c) for c, idx in off.demand().items())
    plan.boundary = 43  # computing from the branch page: nothing to capture there
    assert branch_page(plan) is None
    tree.check_integrity()
