"""One request of a batch: everything the batch holds for it, in one record.

A batch (``engine/batch.py``) keeps one :class:`RequestRecord` per request,
in the order of its plans: the plan (its device-hit lock and pins), the
restore transaction, the compute allocation, the pins on what its forward
reads of a restore, and its status. The batch's exit releases record by
record; nothing about a request lives anywhere else in the batch.

Threads: event loop only.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

import torch

from layerlift.engine.compute import ComputeAlloc
from layerlift.engine.plan import LookupPlan
from layerlift.linker.transaction import RestoreTransaction, TransactionState
from layerlift.pools.base import KVPool
from layerlift.pools.spec import Component

__all__ = ["RequestRecord", "RequestStatus"]


class RequestStatus(enum.Enum):
    RESTORING = "restoring"  # its restore transaction is part of the batch's load
    COMPUTING = "computing"  # it computes from its device hit (nothing to restore)
    RECOMPUTED = "recomputed"  # its restore failed once issued: it computes instead


@dataclass(eq=False)
class RequestRecord:
    """One request of a batch (see the module docstring).

    ``txn`` is set while the request restores and kept once its restore
    landed (FINISHED: its node stays locked until the exit); ``compute`` is
    ``None`` only before PREPARE gave it pages and after the tree or the
    free lists took them; ``pins`` are this batch's pins on the canonical
    pages and slot its forward reads of a restore (which may be another
    request's)."""

    plan: LookupPlan
    txn: RestoreTransaction | None = None
    compute: ComputeAlloc | None = None
    pins: list[tuple[Component, torch.Tensor]] = field(default_factory=list)
    status: RequestStatus = RequestStatus.COMPUTING

    @property
    def rid(self) -> int:
        return self.plan.request_id

    @property
    def published(self) -> bool:
        """Its restore is in the tree (COMMITted, or FINISHED once landed)."""
        live = (TransactionState.COMMITTED, TransactionState.FINISHED)
        return self.txn is not None and self.txn.result is not None and self.txn.state in live

    def cow_slot(self) -> int:
        """The canonical checkpoint slot its forward copies the state from."""
        assert self.txn is not None and self.txn.result is not None
        slot = self.txn.result.cow_source
        assert slot is not None
        return slot

    def read_tables(self) -> tuple[torch.Tensor, torch.Tensor, int | None]:
        """FULL and SWA page indices of the cached prefix ``[0, boundary)``
        and the state slot to copy from: the canonical ones its COMMIT got
        when it restores, its device hit otherwise."""
        plan, b = self.plan, self.plan.boundary
        if self.published and plan.restores:
            assert self.txn is not None and self.txn.result is not None
            canonical = self.txn.result.insert.canonical
            return (canonical[Component.FULL][:b], canonical[Component.SWA][:b],
                    self.cow_slot())
        m = plan.match
        return m.full_indices, m.swa_indices, m.mamba_slot

    def pin_restore(self, pool: KVPool) -> None:
        """Pin what the forward reads of its restore until the batch exits."""
        d, b, w = self.plan.device_pages, self.plan.boundary, self.plan.spec.window_pages
        full, swa, _ = self.read_tables()
        for c, idx in ((Component.FULL, full[d:b]), (Component.SWA, swa[max(d, b - w):b]),
                       (Component.MAMBA, torch.tensor([self.cow_slot()]))):
            if len(idx):
                pool.pin(c, idx)
                self.pins.append((c, idx.clone()))

    def unpin(self, pool: KVPool) -> None:
        """Drop the pins of :meth:`pin_restore` (idempotent)."""
        pins, self.pins = self.pins, []
        for c, idx in pins:
            pool.unpin(c, idx)
