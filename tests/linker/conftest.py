"""Fixtures of the staged-transfer tests."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from layerlift.linker.master import EmbeddedMaster


@pytest.fixture(scope="module")
def long_lease_master(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EmbeddedMaster]:
    """A master of the module's own, leasing reads for 5 s (stopping the
    session's would stall other tests; its 50 ms lease is shorter than a
    session start plus reads on a loaded machine)."""
    log = tmp_path_factory.mktemp("staged") / "mooncake_master.log"
    with EmbeddedMaster(log_path=log, lease_ttl_ms=5000) as master:
        yield master
