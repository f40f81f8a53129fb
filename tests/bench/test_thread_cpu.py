"""Where the process's cores go (`bench/thread_cpu.py`): each thread's CPU
time lands in its group (LayerLift's Mooncake call threads, Python's other
threads, the main thread), a thread that ended in ``ended``, and nothing is
made up where a sample is missing."""

from __future__ import annotations

import threading
import time

import pytest

from layerlift.bench import thread_cpu
from layerlift.bench.thread_cpu import GROUPS, MIN_WALL_TICKS, cores, group_of, sample

pytestmark = pytest.mark.skipif(sample() is None, reason="no /proc/self/task (not Linux)")

SPIN_S = 0.3


def spin(seconds: float) -> None:
    """Keep this thread busy on the CPU for ``seconds`` of its own CPU time."""
    end = time.thread_time() + seconds
    while time.thread_time() < end:
        pass


def test_thread_names_make_the_groups() -> None:
    assert group_of("mooncake-store-3") == "store calls"
    assert group_of("MainThread") == "main"
    assert group_of("layerlift-vllm_0") == "python"
    assert group_of(None) == "native"


def test_busy_threads_land_in_their_groups() -> None:
    """A store-call thread and another Python thread each spin, both alive
    at the second sample (held by an event); the main thread spins too."""
    release = threading.Event()
    spun = [threading.Event(), threading.Event()]

    def work(i: int) -> None:
        spin(SPIN_S)
        spun[i].set()
        release.wait()

    threads = [threading.Thread(target=work, args=(0,), name="mooncake-store-9"),
               threading.Thread(target=work, args=(1,), name="layerlift-test_0")]
    before = sample()
    wall = time.perf_counter()
    for t in threads:
        t.start()
    spin(SPIN_S)
    for e in spun:
        assert e.wait(30)
    after = sample()
    wall = time.perf_counter() - wall
    release.set()
    for t in threads:
        t.join()
    got = cores(before, after, wall)
    assert got is not None and set(got) == set(GROUPS)
    for group in ("store calls", "python", "main"):  # SPIN_S each, ticks of 10 ms
        assert got[group] * wall == pytest.approx(SPIN_S, abs=0.1), (group, got)
    assert got["ended"] * wall < 0.1


def test_a_thread_that_ended_is_counted_as_ended() -> None:
    before = sample()
    wall = time.perf_counter()
    t = threading.Thread(target=spin, args=(SPIN_S,), name="short-lived")
    t.start()
    t.join()
    after = sample()
    wall = time.perf_counter() - wall
    got = cores(before, after, wall)
    assert got is not None
    assert got["ended"] * wall == pytest.approx(SPIN_S, abs=0.1)
    assert got["python"] * wall < 0.05  # its time left with it: not another thread's


def test_missing_samples_make_no_figure(monkeypatch: pytest.MonkeyPatch) -> None:
    now = sample()
    assert cores(None, now, 1.0) is None
    assert cores(now, None, 1.0) is None
    assert cores(now, now, 0.0) is None
    # A step of a few clock ticks (an offload's call that only hands a job
    # over) has no figure: whole ticks per thread would be rounding.
    assert cores(now, now, (MIN_WALL_TICKS - 1) / thread_cpu._TICK) is None
    assert cores(now, now, MIN_WALL_TICKS / thread_cpu._TICK) is not None
    monkeypatch.setattr(thread_cpu, "_TASKS", thread_cpu.Path("/nonexistent/task"))
    assert sample() is None
