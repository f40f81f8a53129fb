"""Fixtures of the SGLang host tests: SGLang caches on CPU whose linkers share
the session's real mooncake_master (tests/conftest.py)."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from typing import Any

import pytest

os.environ.setdefault("MC_LOG_LEVEL", "ERROR")  # Mooncake's glog level, read at client start

from sglang_testkit import SHAPE

from layerlift.linker.master import EmbeddedMaster
from layerlift.testing.sglang_harness import SGLangHost


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
    by SGLang's dynamic loader) uses this test's namespace; closed after."""
    hosts: list[SGLangHost] = []

    def make(**extra: Any) -> SGLangHost:
        namespace = extra.pop("namespace", mooncake_namespace)
        host = SGLangHost(SHAPE, backend="dynamic",
                          config=linker_config(mooncake_master, namespace, **extra))
        hosts.append(host)
        return host

    yield make
    for host in reversed(hosts):
        host.close()
