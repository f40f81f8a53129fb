"""The step-by-step API's handle on one batch (``Engine.load``).

A thin public face over :class:`~layerlift.engine.batch.Batch`, which owns
the batch's state machine and all of its cleanup. The handle holds the
engine's batch lock (through its batch) from ``Engine.load`` until
``forward()`` returned or ``abort()`` finished.
"""

from __future__ import annotations

from layerlift.engine.batch import Batch, BatchState
from layerlift.engine.context import EngineError
from layerlift.engine.plan import LookupPlan
from layerlift.engine.results import PrefillResult
from layerlift.overlap.readiness import LayerReadiness

__all__ = ["EngineError", "LoadHandle"]


class LoadHandle:
    """PREPAREd restores of one batch with their fetches issued."""

    def __init__(self, batch: Batch) -> None:
        self._batch = batch

    @property
    def plans(self) -> list[LookupPlan]:
        return list(self._batch.plans)

    @property
    def state(self) -> BatchState:
        """Where the batch is in its life cycle (see ``engine/batch.py``)."""
        return self._batch.state

    @property
    def readiness(self) -> LayerReadiness:
        """The batch's per-layer readiness (settled at COMMIT when nothing is
        left to load, cancelled on abort or failure)."""
        return self._batch.readiness

    async def issue(self) -> None:
        """Issue the per-layer fetches if ``Engine.load`` has not (it has)."""
        if self._batch.state is BatchState.PREPARED:
            await self._batch.issue()

    def commit(self) -> LayerReadiness:
        """COMMIT: publish the restores, trim the loads, set COW sources;
        returns the per-layer readiness (nothing waits here). Raises
        ``RuntimeError`` if the handle was committed, aborted or finished."""
        return self._batch.commit()

    async def forward(self) -> list[PrefillResult]:
        """Run the forward (committing first if needed), insert the computed
        pages, start their offload, release everything; one result per plan.

        A restore that fails at layer k is recomputed (exact results; the
        result says so). Raises ``EngineError`` if a recompute does not fit,
        ``RuntimeError`` if the handle was aborted or finished. On any
        exception, and on cancellation (which takes effect once the forward
        thread finished its pass), the batch is ABORTed before the exception
        propagates: fetches stopped, restores unpublished, every slot freed."""
        await self.issue()
        return await self._batch.run()

    def abort(self) -> None:
        """ABORT: stop the loads and release everything; the tree ends as it
        was before this batch's COMMIT. Returns at once; ``await aclose()``
        waits until in-flight fetches stopped and the slots are free."""
        self._batch.abort()

    async def aclose(self) -> None:
        """Wait for an ``abort()`` to finish (no-op otherwise)."""
        await self._batch.aclose()
