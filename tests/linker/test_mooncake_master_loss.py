"""Losing the master turns into StoreUnavailable / StoreTimeout within a bound, never a hang."""

from __future__ import annotations

import os
import time

import pytest
import torch

from layerlift.linker.master import EmbeddedMaster
from layerlift.linker.mooncake_store import MooncakeStore
from layerlift.linker.store_base import StoreError, StoreUnavailable

pytestmark = pytest.mark.mooncake

BOUND_S = 15.0


def _process_gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


def test_calls_fail_fast_after_master_loss() -> None:
    master = EmbeddedMaster()
    with master:
        pid = master.pid
        assert pid is not None
        store = MooncakeStore(
            master.config(global_segment_size=16 << 20, local_buffer_size=4 << 20, timeout_s=2.0)
        )
        src = torch.arange(4096, dtype=torch.uint8)
        store.register(src)
        store.put(["loss/a"], [int(src.data_ptr())], [4096])
        master.stop()
        assert _process_gone(pid)
        calls = {
            "exists": lambda: store.exists(["loss/a"]),
            "get": lambda: store.get(["loss/a"], [int(src.data_ptr())], [4096]),
            "put": lambda: store.put(["loss/b"], [int(src.data_ptr())], [4096]),
            "get_ranges": lambda: store.get_ranges(
                ["loss/a"], [[int(src.data_ptr())]], [[16]], [[0]]
            ),
        }
        for name, call in calls.items():
            start = time.monotonic()
            with pytest.raises(StoreUnavailable):
                call()
            assert time.monotonic() - start < BOUND_S, name
        start = time.monotonic()
        store.close()
        assert time.monotonic() - start < BOUND_S
        with pytest.raises(StoreError):
            store.exists(["loss/a"])
    master.stop()  # idempotent
    assert master.pid is None and _process_gone(pid)
