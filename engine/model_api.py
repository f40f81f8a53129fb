"""Moved to :mod:`layerlift.engine.model.api`; kept so that modules still
importing the old path work until they switch (import from
``layerlift.engine.model`` instead)."""

from __future__ import annotations

from layerlift.engine.model.api import (
    ForwardOutput,
    ForwardRequest,
    PoolViews,
    check_pool_indices,
    validate_requests,
)

__all__ = [
    "ForwardOutput",
    "ForwardRequest",
    "PoolViews",
    "check_pool_indices",
    "validate_requests",
]
