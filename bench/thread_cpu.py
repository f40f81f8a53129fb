"""Where this process's cores go, by kind of thread, from ``/proc/self/task``.

``time.process_time`` says how busy the benchmark process was; this says
which of its threads were. :func:`sample` reads every thread's CPU time
(user and system, ``/proc/self/task/TID/stat``) and names it from
:func:`threading.enumerate` (a Python thread's ``native_id``); :func:`cores`
turns two samples over a wall time into cores per group:

* ``store calls``: LayerLift's Mooncake call threads (``mooncake-store-N``,
  ``linker/mooncake_store.py``'s pool): each runs one blocking call of
  Mooncake's client, so its CPU time is Mooncake's client code on the
  caller's side (building the transfer, waiting for it to complete);
* ``native``: threads Python did not start (Mooncake's transfer engine's
  own, torch's intra-op threads);
* ``main``: the main thread (the hosts' stand-in forward thread, which
  waits layer by layer, and the benchmark itself);
* ``python``: every other Python thread (LayerLift's lanes and loops, the
  raw rows' thread pool): LayerLift's own work of a transfer (checksums,
  copies, the ranged call's lists) runs here;
* ``ended``: threads that ended between the samples (their time is in the
  process's total, no longer in a thread's file).

Each thread is read once a sample (a few hundred microseconds for a hundred
threads): read it around a step, not inside the per-layer path. Where
``/proc/self/task`` cannot be read (not Linux), :func:`sample` returns None.
"""

from __future__ import annotations

import os
import threading
from dataclasses import dataclass
from pathlib import Path

from layerlift.bench.machine_cpu import MIN_TICKS

__all__ = ["GROUPS", "MIN_WALL_TICKS", "ThreadSample", "cores", "group_of", "sample"]

GROUPS = ("store calls", "native", "main", "python", "ended")
_TASKS = Path("/proc/self/task")
_PROCESS = Path("/proc/self/stat")
_TICK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
MIN_WALL_TICKS = MIN_TICKS  # the shortest step with a figure, as the machine's


@dataclass(frozen=True, slots=True)
class ThreadSample:
    """Each thread's CPU seconds (by native id, with its group) and the
    process's, at one instant."""

    threads: dict[int, tuple[str, float]]
    process: float


def group_of(name: str | None) -> str:
    """The group of a thread named ``name`` (None: not a Python thread)."""
    if name is None:
        return "native"
    if name.startswith("mooncake-store"):
        return "store calls"
    if name == "MainThread":
        return "main"
    return "python"


def _cpu_seconds(stat: str) -> float:
    """utime + stime of one ``stat`` line (fields 14 and 15; the name in
    parentheses may hold spaces, so count from its closing one)."""
    fields = stat[stat.rindex(")") + 2 :].split()
    return (int(fields[11]) + int(fields[12])) / _TICK


def sample() -> ThreadSample | None:
    """Every thread's CPU time now; None where ``/proc/self/task`` is missing."""
    names = {t.native_id: t.name for t in threading.enumerate() if t.native_id is not None}
    try:  # the process's own line counts threads that ended too, in the same ticks
        process = _cpu_seconds(_PROCESS.read_text())
        tids = os.listdir(_TASKS)
    except OSError:
        return None
    threads: dict[int, tuple[str, float]] = {}
    for tid in tids:
        try:
            stat = (_TASKS / tid / "stat").read_text()
        except OSError:  # it ended meanwhile: counted in "ended"
            continue
        threads[int(tid)] = (group_of(names.get(int(tid))), _cpu_seconds(stat))
    return ThreadSample(threads, process)


def cores(before: ThreadSample | None, after: ThreadSample | None,
          wall: float) -> dict[str, float] | None:
    """Cores per group (:data:`GROUPS`) between two samples over ``wall``
    seconds; a thread started meanwhile counts from zero, one that ended is
    in ``ended`` (the process's time not in any thread that is left). None
    when either sample is missing or ``wall`` is shorter than
    :data:`MIN_WALL_TICKS` clock ticks (each thread's time is counted in
    whole ticks: a step of a few ticks would be rounding, not a figure)."""
    if before is None or after is None or wall < MIN_WALL_TICKS / _TICK:
        return None
    out = dict.fromkeys(GROUPS, 0.0)
    for tid, (group, seconds) in after.threads.items():
        start = before.threads.get(tid, (group, 0.0))[1]
        out[group] += max(0.0, seconds - start)
    # Read a moment apart from the threads' files: never below zero.
    in_threads = sum(out.values())
    out["ended"] = max(0.0, (after.process - before.process) - in_threads)
    return {g: round(v / wall, 3) for g, v in out.items()}
