"""Children (the embedded ``mooncake_master``, namespace hosts' processes)
die with this process but not with the thread that started them.

Before the fix the master was forked by whichever thread called ``start()``
with a parent-death signal, and the engine starts it in an anyio worker
thread, which anyio retires after 10 s idle: the master was SIGKILLed and
every later prefill recomputed ("the master is unreachable").
"""

from __future__ import annotations

import subprocess
import sys
import threading

import pytest

from layerlift.linker.child import spawn_child
from layerlift.linker.master import EmbeddedMaster
from layerlift.linker.mooncake_store import MooncakeStore

OBSERVE_S = 1.0  # the kernel's signal comes at the thread's exit: a killed child is gone by then


def in_short_thread(fn: object) -> object:
    """Run ``fn()`` in a thread that exits right after it; return its result."""
    box: dict[str, object] = {}
    thread = threading.Thread(target=lambda: box.update(out=fn()))  # type: ignore[operator]
    thread.start()
    thread.join()
    return box["out"]


def test_a_child_outlives_the_thread_that_spawned_it() -> None:
    proc = in_short_thread(lambda: spawn_child([sys.executable, "-c", "import time; time.sleep(30)"]))
    assert isinstance(proc, subprocess.Popen)
    try:
        with pytest.raises(subprocess.TimeoutExpired):
            proc.wait(OBSERVE_S)
    finally:
        proc.kill()
        proc.wait()


def test_a_child_dies_with_this_process(tmp_path: object) -> None:
    """A Python process spawns a child and is SIGKILLed: the child goes too."""
    code = (
        "import sys, time; from layerlift.linker.child import spawn_child;"
        "p = spawn_child([sys.executable, '-c', 'import time; time.sleep(60)']);"
        "print(p.pid, flush=True); time.sleep(60)"
    )
    parent = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE)
    assert parent.stdout is not None
    child_pid = int(parent.stdout.readline())
    parent.kill()
    parent.wait()
    for _ in range(200):
        try:
            with open(f"/proc/{child_pid}/stat") as f:
                state = f.read().rsplit(")", 1)[1].split()[0]
        except FileNotFoundError:
            return
        if state == "Z":
            return
        threading.Event().wait(0.01)
    raise AssertionError(f"child {child_pid} survived its parent's death")


@pytest.mark.mooncake
def test_a_master_started_in_a_short_thread_keeps_serving() -> None:
    master = in_short_thread(lambda: EmbeddedMaster(http_metadata=False).start())
    assert isinstance(master, EmbeddedMaster)
    try:
        proc = master._proc
        assert proc is not None
        with pytest.raises(subprocess.TimeoutExpired):
            proc.wait(OBSERVE_S)
        store = MooncakeStore(master.config(global_segment_size=16 << 20,
                                            local_buffer_size=8 << 20, timeout_s=10.0))
        try:
            assert store.exists(["child-test/none"]) == [False]
        finally:
            store.close()
    finally:
        master.stop()
