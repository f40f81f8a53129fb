"""Every wait behind a handle that waits for its caller is bounded (issue 44).

A step-by-step handle holds the device (and, while its load is in flight,
the load lock) until its caller moves it on. Another request waits behind a
holder that progresses as long as it takes, and behind one that waits for
its caller at most ``layer_wait_timeout_s``: then ``EngineError`` names the
holder's requests and what it waits for. The holder stays valid: its
caller can still rerun (the results are exact) or abort, and nothing leaks.

Each state an external forward can be left in is one case; each failed on
the main before this file (the prefill behind it waited past ``WAIT_S``):

* ``not-started``: ``begin_external()`` and no forward;
* ``rerun-after-done``: the host skipped its waits, ``done()`` raised
  ``RerunRequired``, the host neither reran nor aborted;
* ``rerun-after-failed``: ``failed()`` returned the requests to run again,
  never run;
* ``timed-out-wait``: the host's ``wait()`` raised ``LayerWaitTimeout`` and
  the host called neither ``failed()`` nor ``abort()``;
* ``raised-in-running``: the host's forward raised inside ``running()``
  and nothing followed.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Awaitable, Callable
from typing import Any

import anyio
import pytest
import torch

from layerlift import Engine, EngineConfig, EngineError, HybridModel
from layerlift.engine.handle import ExternalForward, RerunRequired
from layerlift.engine.model.api import ForwardRequest
from layerlift.engine.results import PrefillResult
from layerlift.linker.memory_store import MemoryStore
from layerlift.overlap.base import LayerLoadError, LayerWaitTimeout
from layerlift.testing import FaultyStore, assert_quiescent, offload_and_drop
from layerlift.testing.reference import assert_exact, cold_prefills, random_prompts

BOUND_S = 0.5  # layer_wait_timeout_s
WAIT_S = 20.0  # what "waited past its bound" means here (the main waited forever)


def forward(model: Any, engine: Engine, ext: ExternalForward,
            requests: list[ForwardRequest], wait: Callable[[int], None]) -> torch.Tensor:
    """The host's forward in the rule's context manager; ``wait`` is its
    layer hook's wait (``ext.wait``, or one that skips)."""
    with ext.running():
        out = model.forward_batch(requests, engine.pool, wait, lambda layer: None)
    return out.next_token_logprobs


async def rerun(model: Any, engine: Engine, ext: ExternalForward,
                requests: list[ForwardRequest]) -> list[PrefillResult]:
    """What a host that resumes does: run the requests (waiting per layer)
    until ``done()`` takes them."""
    for _ in range(3):
        try:
            logprobs = await anyio.to_thread.run_sync(
                forward, model, engine, ext, requests, ext.wait)
        except (LayerLoadError, LayerWaitTimeout) as err:
            requests = await ext.failed(err)
            continue
        try:
            return await ext.done(logprobs)
        except RerunRequired as again:
            requests = again.requests
    raise AssertionError("the host forward kept failing")


class Left:
    """One state a host leaves its external forward in, and how it resumes."""

    def __init__(self, model: HybridModel, engine: Engine, store: FaultyStore,
                 ext: ExternalForward) -> None:
        self.model, self.engine, self.store, self.ext = model, engine, store, ext
        self.resume: Callable[[], Awaitable[list[PrefillResult] | None]] = self._rerun_own
        self.gate: threading.Event | None = None

    async def _rerun_own(self) -> list[PrefillResult]:
        return await rerun(self.model, self.engine, self.ext, self.ext.requests)

    async def rerun_after_done(self) -> None:
        skip = lambda layer: None  # noqa: E731  (a host that skipped its waits)
        logprobs = await anyio.to_thread.run_sync(
            forward, self.model, self.engine, self.ext, self.ext.requests, skip)
        with pytest.raises(RerunRequired) as told:
            await self.ext.done(logprobs)
        requests = told.value.requests
        self.resume = lambda: rerun(self.model, self.engine, self.ext, requests)

    async def rerun_after_failed(self) -> None:
        with pytest.raises(LayerLoadError) as failed:
            await anyio.to_thread.run_sync(
                forward, self.model, self.engine, self.ext, self.ext.requests, self.ext.wait)
        requests = await self.ext.failed(failed.value)
        self.resume = lambda: rerun(self.model, self.engine, self.ext, requests)

    async def timed_out_wait(self) -> None:
        # No running(): the forward stays marked running, as a host that
        # stopped at its failed wait leaves it.
        with pytest.raises(LayerWaitTimeout) as late:
            await anyio.to_thread.run_sync(
                lambda: [self.ext.wait(layer, None if layer < 3 else 0.05) for layer in range(4)])
        assert self.gate is not None
        self.gate.set()  # the read lands; the batch still waits for its host
        error = late.value

        async def resume() -> list[PrefillResult]:
            return await rerun(self.model, self.engine, self.ext, await self.ext.failed(error))
        self.resume = resume

    async def raised_in_running(self) -> None:
        def broken(layer: int) -> None:
            if layer == 2:
                raise RuntimeError("the host's layer hook broke")
            self.ext.wait(layer)
        with pytest.raises(RuntimeError, match="layer hook broke"):
            await anyio.to_thread.run_sync(
                forward, self.model, self.engine, self.ext, self.ext.requests, broken)

        async def resume() -> None:
            self.ext.abort()
            await self.ext.aclose()
        self.resume = resume


STATES = {
    "not-started": (None, "has not started"),
    "rerun-after-done": (Left.rerun_after_done, r"done\(\) raised RerunRequired"),
    "rerun-after-failed": (Left.rerun_after_failed, r"failed\(\) returned the requests"),
    "timed-out-wait": (Left.timed_out_wait, r"wait for layer 3 raised LayerWaitTimeout"),
    "raised-in-running": (Left.raised_in_running, r"returned without done\(\)"),
}


@pytest.mark.parametrize("state", list(STATES))
async def test_a_request_behind_a_handle_left_waiting_gets_a_bounded_error(
        tiny_model: HybridModel, state: str) -> None:
    leave, says = STATES[state]
    a, b = random_prompts(tiny_model, 440, [300, 310])
    ref_a, ref_b = await cold_prefills(tiny_model, [a, b])
    store = FaultyStore(MemoryStore(), tiny_model.spec)
    cfg = EngineConfig(store="memory", pool_bytes=16 << 20, layer_wait_timeout_s=BOUND_S)
    async with Engine(tiny_model, cfg, store=store) as engine:
        await engine.prefill([a])
        await offload_and_drop(engine)
        gate = threading.Event()
        if state == "timed-out-wait":
            store.gate_layer(3, gate)
        elif state in ("rerun-after-done", "rerun-after-failed"):
            store.fail_layer(5)
        plan = await engine.lookup(a)
        handle = await engine.load([plan])
        left = Left(tiny_model, engine, store, handle.begin_external())
        left.gate = gate
        if leave is not None:
            await leave(left)
        store.clear()

        started = time.monotonic()
        with pytest.raises(EngineError, match=rf"requests \[{plan.request_id}\] \(.*{says}"):
            async with asyncio.timeout(WAIT_S):
                await engine.prefill([b])
        waited = time.monotonic() - started
        assert waited < 4 * BOUND_S + 2.0, f"the error came after {waited:.1f} s"

        # The handle is still its caller's: it resumes (exact) or aborts.
        got = await left.resume()
        if got is not None:
            assert_exact(got, [ref_a])
        (again,) = await engine.prefill([b])
        assert_exact([again], [ref_b])
        await engine.wait_offloads()
        assert_quiescent(engine)


async def test_a_running_host_forward_is_waited_for_past_the_bound(
        tiny_model: HybridModel) -> None:
    """The control: a host forward that progresses (held inside a layer's
    compute, its waits answered) is not a holder that waits for its caller:
    the prefill behind it waits past the bound and is served after it."""
    a, b = random_prompts(tiny_model, 441, [300, 310])
    ref_a, ref_b = await cold_prefills(tiny_model, [a, b])
    cfg = EngineConfig(store="memory", pool_bytes=16 << 20, layer_wait_timeout_s=BOUND_S)
    async with Engine(tiny_model, cfg) as engine:
        await engine.prefill([a])
        await offload_and_drop(engine)
        ext = (await engine.load([await engine.lookup(a)])).begin_external()
        reached, gate = threading.Event(), threading.Event()

        def held(layer: int) -> None:
            ext.wait(layer)
            if layer == 2:
                reached.set()
                gate.wait(WAIT_S)

        host = asyncio.ensure_future(anyio.to_thread.run_sync(
            forward, tiny_model, engine, ext, ext.requests, held))
        try:
            assert await anyio.to_thread.run_sync(reached.wait, WAIT_S)
            behind = asyncio.create_task(engine.prefill([b]))
            done, _ = await asyncio.wait({behind}, timeout=6 * BOUND_S)
            assert not done, f"gave up behind a running host forward: {behind.exception()!r}"
        finally:
            gate.set()
        (got_a,) = await ext.done(await host)
        (got_b,) = await behind
        assert_exact([got_a, got_b], [ref_a, ref_b])
        await engine.wait_offloads()
        assert_quiescent(engine)


async def test_a_request_waiting_for_room_behind_a_rerun_is_bounded(
        tiny_model: HybridModel) -> None:
    """The room wait: a prompt that does not fit beside a batch told to
    rerun (``RerunRequired``, neither rerun nor aborted) gets an
    ``EngineError`` naming that batch after the bound (before: it waited as
    long as it would behind a forward that computes); the handle then
    reruns exactly and the prompt is served."""
    a, b = random_prompts(tiny_model, 442, [2600, 1500])
    ref_a, ref_b = await cold_prefills(tiny_model, [a, b])
    store = FaultyStore(MemoryStore(), tiny_model.spec)
    cfg = EngineConfig(store="memory", pool_bytes=6 << 20, layer_wait_timeout_s=BOUND_S)
    async with Engine(tiny_model, cfg, store=store) as engine:
        await engine.prefill([a])
        await offload_and_drop(engine)
        store.fail_layer(5)
        plan = await engine.lookup(a)
        left = Left(tiny_model, engine, store, (await engine.load([plan])).begin_external())
        await left.rerun_after_done()
        store.clear()
        with pytest.raises(EngineError, match=rf"room stayed held.*requests \[{plan.request_id}\] "
                                              r"\(told to rerun"):
            async with asyncio.timeout(WAIT_S):
                await engine.prefill([b])
        assert_exact(await left.resume() or [], [ref_a])
        (got_b,) = await engine.prefill([b])
        assert_exact([got_b], [ref_b])
        await engine.wait_offloads()
        assert_quiescent(engine)
