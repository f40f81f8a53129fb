"""Cores busy on the whole machine over a stretch of wall time, from
``/proc/stat``: every process's and the kernel's work (a storage node in
another process, a namespace link's veth and ``tbf`` work in softirqs), not
only the benchmark process's (``time.process_time``). A row whose machine
figure is near the CPU count had no core left for anything to overlap with.

``sample()`` reads the counters; ``cores(before, after)`` is the machine's
busy CPU time over that wall time, in cores; :class:`Busy` adds up several
stretches (the repeats of one run). Busy is every state but idle,
iowait and steal (time a hypervisor gave to another guest is not this
machine's work). Where ``/proc/stat`` cannot be read (not Linux), both
return None.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

__all__ = ["MIN_TICKS", "Busy", "CpuSample", "cores", "sample"]

_STAT = Path("/proc/stat")
MIN_TICKS = 20  # the shortest stretch with a figure, in clock ticks (0.2 s at 100 a second)
_NOT_BUSY = (3, 4, 7)  # idle, iowait, steal: the fields after "cpu", from 0


@dataclass(frozen=True, slots=True)
class CpuSample:
    """The machine's CPU counters at one instant (jiffies, all CPUs summed)."""

    busy: int
    total: int
    cpus: int


def sample() -> CpuSample | None:
    """The counters now; None where ``/proc/stat`` is missing or unreadable."""
    try:
        lines = _STAT.read_text().splitlines()
    except OSError:
        return None
    fields = [int(x) for x in lines[0].split()[1:]] if lines and lines[0].startswith("cpu ") \
        else []
    cpus = sum(1 for line in lines if line.startswith("cpu") and line[3:4].isdigit())
    if len(fields) < 8 or cpus == 0:
        return None
    total = sum(fields[:8])  # guest time is already counted in user
    idle = sum(fields[i] for i in _NOT_BUSY)
    return CpuSample(total - idle, total, cpus)


def cores(before: CpuSample | None, after: CpuSample | None) -> float | None:
    """Cores busy machine-wide between two samples (0 to ``cpus``); None
    when either is missing or fewer than :data:`MIN_TICKS` clock ticks
    passed between them (counters in whole ticks: a step of a tick or two,
    such as a call that only hands a job over, would read 0 or every core)."""
    if before is not None and after is not None and \
            after.total - before.total < MIN_TICKS * after.cpus:
        return None
    one = Busy()
    one.add(before, after)
    return one.cores


class Busy:
    """The machine's busy cores over several stretches together (``add``
    each one's samples; ``cores``: None until a tick passed in one)."""

    def __init__(self) -> None:
        self.busy = self.total = self.cpus = 0

    def add(self, before: CpuSample | None, after: CpuSample | None) -> None:
        if before is None or after is None:
            return
        self.busy += after.busy - before.busy
        self.total += after.total - before.total
        self.cpus = after.cpus

    @property
    def cores(self) -> float | None:
        return self.busy / self.total * self.cpus if self.total > 0 else None
