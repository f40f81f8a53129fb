"""Multi-host fixtures: a Mooncake master, a storage node and engines, each in
its own network namespace (``layerlift.testing.netns``), real Mooncake TCP
between them. Never skipped: a ``netns`` test that skips counts as a failure
(tests/conftest.py); they need root, as in CI."""

from __future__ import annotations

import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
from netns_cluster import STARTED, Cluster

from layerlift.testing import NetnsHosts, netns_available
from layerlift.testing.netns import leftover_namespaces


def _veths() -> set[str]:
    """veth interfaces of this (the root) namespace."""
    out = subprocess.run(["ip", "-o", "link", "show", "type", "veth"],
                         capture_output=True, text=True, check=True).stdout  # fmt: skip
    return {line.split(":")[1].strip().split("@")[0] for line in out.splitlines()}


@pytest.fixture(scope="session", autouse=True)
def _nothing_left_behind() -> Iterator[None]:
    """At session end: no namespace, veth or process of the netns tests still exists."""
    ok, why = netns_available()
    if not ok:
        pytest.skip(f"network namespaces unavailable: {why}")  # counted as a failure
    veths_before = _veths()
    yield
    assert not leftover_namespaces(), f"namespaces left behind: {leftover_namespaces()}"
    assert _veths() <= veths_before, f"veths left behind: {_veths() - veths_before}"
    alive = [p.pid for p in STARTED if p.poll() is None]
    assert not alive, f"processes left running by the netns tests: {alive}"


@pytest.fixture
def cluster(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Cluster]:
    """A master and a storage node on their own hosts; engines are started by the test.
    ``@pytest.mark.parametrize("cluster", [{"engine": "20mbit"}], indirect=True)``
    throttles links."""
    rates: dict[str, str] = getattr(request, "param", {})
    # Nothing to save at the end: no grace for SIGTERM (the master takes 2.5 s to exit).
    with NetnsHosts(["master", "store", "engine", "engine2"], rates=rates, grace_s=0.5) as hosts:
        c = Cluster(hosts, tmp_path)
        c.start_master()
        c.start_store()
        yield c
