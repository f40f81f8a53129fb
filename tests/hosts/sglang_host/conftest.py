"""Fixtures of the SGLang host tests: SGLang caches on CPU whose linkers share
the session's real mooncake_master (tests/conftest.py)."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from typing import Any

import pytest

os.environ.setdefault("MC_LOG_LEVEL", "ERROR")  # Mooncake's glog level, read at client start

from sglang_testkit import SHAPE, RawStore

from layerlift.linker.master import EmbeddedMaster
from layerlift.testing.faults import ProcessStall
from layerlift.testing.sglang_harness import SGLangHost


@pytest.fixture(scope="session")
def mooncake_master(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EmbeddedMaster]:
    """The session's mooncake_master for the SGLang tests, with a 1 s read
    lease (the suite's default 50 ms expires inside one batch's reads on a
    loaded machine: LEASE_EXPIRED fails the load); a removal waits it out."""
    log = tmp_path_factory.mktemp("mooncake-sglang") / "mooncake_master.log"
    with EmbeddedMaster(log_path=log, lease_ttl_ms=1000) as master:
        yield master


def linker_config(master: EmbeddedMaster, namespace: str, **extra: Any) -> dict[str, Any]:
    """The --unified-cache-external-linker-config a launch would pass."""
    settings = {"master_address": master.master_address, "namespace": namespace,
                "model": "tiny-hybrid", "segment_mib": 32, "staging_mib": 8,
                "timeout_s": 2.0, "load_timeout_s": 3.0, **extra}
    return {"linker": "LayerLiftLinker", "linker_module_path": "layerlift.hosts.sglang",
            "linker_extra_config": settings}


@pytest.fixture
def make_host(mooncake_master: EmbeddedMaster,
              mooncake_namespace: str) -> Iterator[Callable[..., SGLangHost]]:
    """``make_host(**extra)``: a new SGLang cache whose LayerLift linker (made
    by SGLang's dynamic loader) uses this test's namespace; closed after.
    ``shape`` and ``host`` (a dict of ``SGLangHost`` options) shape the cache;
    the rest is ``linker_extra_config``."""
    hosts: list[SGLangHost] = []

    def make(**extra: Any) -> SGLangHost:
        namespace = extra.pop("namespace", mooncake_namespace)
        shape = extra.pop("shape", SHAPE)
        options = extra.pop("host", {})
        host = SGLangHost(shape, backend="dynamic",
                          config=linker_config(mooncake_master, namespace, **extra), **options)
        hosts.append(host)
        return host

    yield make
    for host in reversed(hosts):
        host.close()


@pytest.fixture
def raw(mooncake_master: EmbeddedMaster) -> Iterator[RawStore]:
    client = RawStore(mooncake_master)
    yield client
    client.store.close()


@pytest.fixture
def stall(mooncake_master: EmbeddedMaster) -> Iterator[ProcessStall]:
    assert mooncake_master.pid is not None
    s = ProcessStall(mooncake_master.pid)
    yield s
    s.release()
