"""Child processes that die with this process, started from a thread that lives as long as they do.

On Linux the kernel can SIGKILL a child when its parent dies
(``PR_SET_PDEATHSIG``), so a crashed engine leaves no ``mooncake_master``
behind. But "parent" is the *thread* that forked it: a child started from a
short-lived worker thread (an anyio worker retired after 10 s idle, an
``asyncio.to_thread`` call) is killed when that thread exits, long before the
process does. :func:`spawn_child` therefore forks from a thread of its own
that waits for the child and exits only once the child has: the signal fires
when the process dies (all its threads go), never earlier.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import subprocess
import sys
import threading
from collections.abc import Sequence
from typing import Any

__all__ = ["spawn_child"]

_PR_SET_PDEATHSIG = 1


def _die_with_parent(parent_pid: int) -> None:
    """preexec_fn: ask the kernel to SIGKILL the child when its parent thread dies."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if os.getppid() != parent_pid:  # the parent died before prctl took effect
        os._exit(1)


def spawn_child(command: Sequence[str], *, name: str = "child",
                **popen: Any) -> subprocess.Popen[bytes]:
    """``subprocess.Popen(command, **popen)`` from a keeper thread that lives
    until the child exits; on Linux the child is SIGKILLed if this process
    dies. Safe to call from any thread, a short-lived one included. Raises
    what ``Popen`` raises (``FileNotFoundError``, ``OSError``)."""
    if "preexec_fn" in popen:
        raise ValueError("spawn_child sets preexec_fn itself")
    parent = os.getpid()
    if sys.platform == "linux":
        popen["preexec_fn"] = lambda: _die_with_parent(parent)
    started = threading.Event()
    box: dict[str, Any] = {}

    def keeper() -> None:
        try:
            box["proc"] = proc = subprocess.Popen(list(command), **popen)
        except BaseException as exc:
            box["error"] = exc
            started.set()
            return
        started.set()
        proc.wait()  # this thread is the child's parent: it must outlive the child

    threading.Thread(target=keeper, name=f"layerlift-keeper-{name}", daemon=True).start()
    started.wait()
    if "error" in box:
        raise box["error"]
    proc: subprocess.Popen[bytes] = box["proc"]
    return proc
