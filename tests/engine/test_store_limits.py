"""A full store and an outage (issue 21, findings 2 and 3).

* A prefix larger than the store's capacity is not offloaded (said once);
  what the store holds stays restorable.
* A put refused for lack of space backs that node off (its next 2, 4, ...
  offloads are skipped) instead of putting everything again every prefill.
* An outage logs one warning, then a summary at most every N seconds, and
  the offload report keeps counters and the last few errors only.
"""

from __future__ import annotations

import logging

import numpy as np
import pytest

from layerlift import Engine, EngineConfig, HybridModel, ModelSpec
from layerlift.engine.offload import FailureLog, OffloadReport
from layerlift.linker.memory_store import MemoryStore
from layerlift.linker.store_base import StoreFull, StoreUnavailable
from layerlift.testing import FaultyStore, assert_quiescent, kl_divergence, offload_and_drop
from layerlift.testing.reference import cold_prefills, random_prompts

KL_TOL = 1e-6
POOL = 32 << 20


@pytest.fixture(scope="module")
def model() -> HybridModel:
    return HybridModel(ModelSpec.preset("tiny"), seed=0)


async def stored_bytes(model: HybridModel, p: np.ndarray) -> int:
    """Bytes one prompt's offload puts in an empty store."""
    store = MemoryStore()
    async with Engine(model, EngineConfig(store="memory", pool_bytes=POOL), store=store) as e:
        await e.prefill([p])
        await e.wait_offloads()
    return store.used_bytes


def puts_of(store: MemoryStore) -> int:
    return sum(1 for c in store.calls if c.method == "put_parts")


async def test_a_prefix_larger_than_the_store_is_not_offloaded(
        model: HybridModel, caplog: pytest.LogCaptureFixture) -> None:
    small, big = random_prompts(model, 1, [256, 1200])
    need_small, need_big = await stored_bytes(model, small), await stored_bytes(model, big)
    assert need_big > need_small
    store = MemoryStore(capacity_bytes=need_small + (need_big - need_small) // 2)
    (ref,) = await cold_prefills(model, [small], pool_bytes=POOL)
    async with Engine(model, EngineConfig(store="memory", pool_bytes=POOL), store=store) as e:
        await e.prefill([small])
        await offload_and_drop(e)
        assert puts_of(store) == 1
        with caplog.at_level(logging.WARNING, logger="layerlift.engine"):
            for _ in range(3):
                await e.prefill([big])
                await e.wait_offloads()
                e.drop_device_cache()
        said = [r for r in caplog.records if "more than its capacity" in r.getMessage()]
        assert len(said) == 1, [r.getMessage() for r in caplog.records]
        report = await e.wait_offloads()
        assert report.too_big == 3 and report.failed == 0 and puts_of(store) == 1
        e.pool.buffer.zero_()
        got = (await e.prefill([small]))[0]  # nothing was evicted for the big one
        assert kl_divergence(ref.next_token_logprobs, got.next_token_logprobs) <= KL_TOL
        assert got.restored_tokens > 0 and not got.recomputed_after_failure
        await e.wait_offloads()
        assert_quiescent(e)


async def test_a_full_store_backs_the_node_off(model: HybridModel) -> None:
    """The store holds the first prompt; the second fits the store alone but
    not beside it: its put fails with StoreFull; of its next prefills (device
    hits, each would offload again) the next 2 skip the put, the 3rd tries
    once more and fails, and the next 4 skip."""
    first, second = random_prompts(model, 2, [600, 600])
    need = await stored_bytes(model, first)
    store = MemoryStore(capacity_bytes=need + need // 2)
    async with Engine(model, EngineConfig(store="memory", pool_bytes=POOL), store=store) as e:
        await e.prefill([first])
        await e.wait_offloads()
        attempts = []
        for _ in range(1 + 2 + 1 + 4):
            before = puts_of(store)
            await e.prefill([second])
            await e.wait_offloads()
            attempts.append(puts_of(store) - before)
        assert attempts == [1, 0, 0, 1, 0, 0, 0, 0], attempts
        report = e.offloader.report
        assert report.failed == 2 and report.failures == {"StoreFull": 2}
        assert report.backed_off == 6
        assert_quiescent(e)


async def test_an_outage_logs_once_and_counts(model: HybridModel,
                                              caplog: pytest.LogCaptureFixture) -> None:
    """40 prefills with the store down: one warning (the summary interval is
    30 s), 40 failures counted, at most 8 messages kept; then the store comes
    back: one line says so and the offloads land."""
    ps = random_prompts(model, 3, [80] * 41)
    faulty = FaultyStore(MemoryStore(), model.spec)
    async with Engine(model, EngineConfig(store="memory", pool_bytes=POOL), store=faulty) as e:
        faulty.down = True
        with caplog.at_level(logging.WARNING, logger="layerlift.engine"):
            for p in ps[:40]:
                await e.prefill([p])
                await e.wait_offloads()
            failed = [r for r in caplog.records if "offload to the store" in r.getMessage()]
            assert len(failed) == 1, [r.getMessage() for r in failed]
            report = e.offloader.report
            assert report.failed == 40 and report.failures == {"StoreUnavailable": 40}
            assert len(report.errors) == 8
            faulty.down = False
            await e.prefill([ps[40]])
            await e.wait_offloads()
        back = [r for r in caplog.records if "works again after 40" in r.getMessage()]
        assert len(back) == 1
        assert e.offloader.report.objects > 0


def test_failure_log_summarises_at_most_every_interval() -> None:
    now = [0.0]
    logger = logging.getLogger("test.failure_log")
    records: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            records.append(record.getMessage())

    handler = Keep()
    logger.addHandler(handler)
    try:
        flog = FailureLog("the thing", interval_s=10.0, clock=lambda: now[0], logger=logger)
        for t in range(25):  # one failure per second for 25 s
            now[0] = float(t)
            flog.failed(StoreUnavailable(f"down at {t}"))
        flog.succeeded()
    finally:
        logger.removeHandler(handler)
    assert len(records) == 4, records  # first, at 10 s, at 20 s, recovered
    assert "failed (will retry" in records[0]
    assert "10 more time(s)" in records[1] and "10 more time(s)" in records[2]
    assert "works again after 25" in records[3]
    with pytest.raises(ValueError, match="interval_s must be positive"):
        FailureLog("x", interval_s=0)


def test_report_is_bounded() -> None:
    report = OffloadReport()
    for i in range(1000):
        report.record_failure(StoreFull(f"full {i}"))
    assert report.failed == 1000 and len(report.errors) == 8
    assert report.errors[-1] == "full 999" and report.failures == {"StoreFull": 1000}


@pytest.mark.mooncake
def test_the_embedded_store_knows_its_capacity() -> None:
    """The embedded master's only segment is the engine's: its size is the
    store's capacity, so a prefix larger than it is never offloaded."""
    from layerlift.engine.stores import open_store

    handle = open_store(EngineConfig(store="embedded", segment_bytes=16 << 20))
    try:
        assert handle.store.capacity_bytes == 16 << 20
    finally:
        handle.close()
    with pytest.raises(ValueError, match="at least 16 MiB"):
        open_store(EngineConfig(store="embedded", segment_bytes=8 << 20))
