"""Fixtures shared by the overlap tests."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest

from layerlift.overlap import CpuLane


@pytest.fixture
async def lane() -> AsyncIterator[CpuLane]:
    """A CPU lane with enough workers for every test's in-flight bound."""
    lane = CpuLane(max_workers=4)
    yield lane
    lane.close()
