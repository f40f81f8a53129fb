"""What the scheduler-side connector tells the worker-side one each step.

Plain picklable dataclasses (vLLM ships `SchedulerOutput` to the worker
process). An *item* is one store object and the vLLM block it fills or
comes from: ``(group index, page hash, block id)``; each worker turns the
page hash into the key of its own tensor-parallel rank's shard.
"""

from __future__ import annotations

from dataclasses import dataclass, field

__all__ = ["Item", "LoadSpec", "SaveSpec", "StepMeta", "WorkerReport"]

Item = tuple[int, bytes, int]


@dataclass(slots=True)
class LoadSpec:
    """Restore ``items`` into one request's blocks before it is scheduled.

    ``refused``: the scheduler promised tokens it cannot place (a block it
    needs is vLLM's null block); the worker reports the load failed at once.
    ``sync``: vLLM runs this step's forward while the load goes on (layer
    ``l`` waits for layer ``l``); failures are reported as block ids at the
    step's end. Otherwise the request waits for the whole load.
    """

    req_id: str
    items: list[Item]
    refused: bool = False
    sync: bool = False


@dataclass(slots=True)
class SaveSpec:
    """Offload ``items`` (pages completed this step, or a recurrent checkpoint
    taken at the step's end) of one request.

    ``job``: the scheduler holds a reference on every block of ``items``
    (vLLM's block pool) until each worker reported this job done
    (`WorkerReport.saved`): the worker may read the blocks after the step,
    in the background. None: nothing holds them past the step; the worker
    copies them before ``save`` returns."""

    req_id: str
    items: list[Item]
    job: int | None = None


@dataclass(slots=True)
class StepMeta:
    """The worker's work for one step (a `KVConnectorMetadata` in the connector)."""

    loads: list[LoadSpec] = field(default_factory=list)
    saves: list[SaveSpec] = field(default_factory=list)


@dataclass(slots=True)
class WorkerReport:
    """What the workers tell the scheduler after a step (a
    `KVConnectorWorkerMetadata` in the connector; the reports of a step's
    workers are merged): ``corrupt``: objects that failed their check, as
    ``(group index, page hash)``; ``replaced``: objects a worker replaced by
    a computed copy, as ``(TP rank, group index, page hash)``; ``failed``:
    requests whose synchronous restore of a multi-group model did not land
    verified this step (`LayerLiftScheduler` recomputes or fails them; vLLM's
    own scheduler cannot map block ids of several groups back to requests);
    ``saved``: save jobs (`SaveSpec.job`) whose blocks these workers read no
    more, each with how many workers say so (one each: merged, the counts add
    up; the scheduler drops its block references once every worker did)."""

    corrupt: set[tuple[int, bytes]] = field(default_factory=set)
    replaced: set[tuple[int, int, bytes]] = field(default_factory=set)
    failed: set[str] = field(default_factory=set)
    saved: dict[int, int] = field(default_factory=dict)

    def merge(self, other: WorkerReport) -> WorkerReport:
        saved = dict(self.saved)
        for job, count in other.saved.items():
            saved[job] = saved.get(job, 0) + count
        return WorkerReport(self.corrupt | other.corrupt, self.replaced | other.replaced,
                            self.failed | other.failed, saved)

    def __bool__(self) -> bool:
        return bool(self.corrupt or self.replaced or self.failed or self.saved)
