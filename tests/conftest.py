"""Shared fixtures. Mooncake: a real master for the whole session (never skipped).
``any_device``: the simulated device, and CUDA (marked ``gpu``) where there is one."""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from layerlift.linker.master import EmbeddedMaster
from layerlift.linker.mooncake_store import MooncakeStore


def _child_masters() -> list[int]:
    """Pids of mooncake_master processes whose parent is this test process."""
    pids = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)
            name = fields[0].split("(", 1)[1]
            ppid = int(fields[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        if ppid == os.getpid() and name.startswith("mooncake_master"):
            pids.append(int(stat.parent.name))
    return pids


@pytest.fixture(scope="session", autouse=True)
def _no_leftover_mooncake_masters() -> Iterator[None]:
    """At session end, fail if a mooncake_master started by the suite still runs."""
    yield
    left = _child_masters()
    assert not left, f"mooncake_master processes left running by the test suite: {left}"


@pytest.fixture(scope="session")
def mooncake_master(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EmbeddedMaster]:
    """A mooncake_master on loopback for the session. Fails (never skips) if it cannot start.
    Its read lease is 50 ms (the library's default is 5 s) so that tests can
    ``remove`` soon after a read; the tests that read longer start masters of their own."""
    log = tmp_path_factory.mktemp("mooncake") / "mooncake_master.log"
    with EmbeddedMaster(log_path=log, lease_ttl_ms=50) as master:
        yield master


@pytest.fixture
def mooncake_namespace() -> str:
    """A key prefix unique to this test: tests share one master, so keys must not collide."""
    return f"test-{uuid.uuid4().hex[:12]}"


@pytest.fixture
def mooncake_store(mooncake_master: EmbeddedMaster) -> Iterator[MooncakeStore]:
    """A MooncakeStore client with a 64 MiB segment and a 32 MiB local buffer, closed after.

    Prefix its keys with `mooncake_namespace`.
    """
    config = mooncake_master.config(
        global_segment_size=64 << 20, local_buffer_size=32 << 20, timeout_s=10.0
    )
    store = MooncakeStore(config)
    try:
        yield store
    finally:
        store.close()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]):  # type: ignore[no-untyped-def]
    """A Mooncake or netns test that skips is a failure: the store and the
    multi-host paths must be exercised."""
    outcome = yield
    report = outcome.get_result()
    for marker in ("mooncake", "netns"):
        if report.skipped and item.get_closest_marker(marker) is not None:
            report.outcome = "failed"
            report.longrepr = f"{marker} test {item.nodeid} was skipped; {marker} tests must run"


_NO_GPU = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")


@pytest.fixture(params=[pytest.param("sim", id="sim"),
                        pytest.param("cuda", id="cuda", marks=[pytest.mark.gpu, _NO_GPU])])
def any_device(request: pytest.FixtureRequest) -> Iterator[Any]:
    """A device path's test on the simulated device (streams that run late)
    and, marked ``gpu``, on CUDA (skipped with its reason elsewhere)."""
    if request.param == "sim":
        from layerlift.testing.simdevice import SimDevice

        device = SimDevice(seed=9, max_delay_s=0.001)
        yield device
        device.close()
        return
    from layerlift.overlap.device import CudaDevice

    yield CudaDevice()
