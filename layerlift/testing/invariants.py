"""The engine's invariants after any outcome, as one check tests call.

After every prefill, abort, failure or cancellation, once offloads are done:
the load and device locks are free, no node is locked or carries a pending load, no page
is pinned, the tree's integrity and the pool's byte accounting hold.
"""

from __future__ import annotations

from typing import Any

__all__ = ["assert_quiescent", "offload_and_drop"]


def assert_quiescent(engine: Any) -> None:
    """Raise ``AssertionError`` naming what is still held. Call after
    ``await engine.wait_offloads()`` (offloads pin pages while they run)."""
    ctx = engine._ctx
    assert not ctx.lock.locked(), "the load lock is still held"
    assert not ctx.device.locked(), "the device lock is still held"
    engine.tree.check_integrity()
    engine.pool.verify_byte_accounting()
    locked = engine.tree.stats().locked_nodes
    assert locked == 0, f"{locked} tree nodes are still locked"
    pending = [n for n in engine.tree.iter_nodes() if n.pending is not None]
    assert not pending, f"{len(pending)} tree nodes still carry a pending load"
    core = getattr(engine.pool, "core", None)
    if core is not None:
        pinned = {a.name: int((a.pins > 0).sum()) for a in core.chain}
        assert not any(pinned.values()), f"pages still pinned: {pinned}"


async def offload_and_drop(engine: Any, *, expect_ok: bool = True) -> None:
    """Wait for every offload (``expect_ok``: none failed), empty the device
    cache and zero the (now empty) pool, so that a restore that reads a slot
    it never loaded cannot pass by finding the old bytes there."""
    report = await engine.wait_offloads()
    if expect_ok:
        assert report.ok, f"offloads failed: {report}"
    engine.drop_device_cache()
    buffer = engine.pool.buffer
    buffer.zero_()
    if buffer.device.type == "cuda":
        import torch

        torch.cuda.synchronize(buffer.device)
