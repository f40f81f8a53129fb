"""Routers of a fleet: which instance serves the next request.

Each router sees every instance through :class:`InstanceView` (its engine,
and what it has been sent but not yet answered) and picks one index:

* ``round-robin``: in turn.
* ``least-loaded``: fewest queued prompt tokens (sent, not yet answered);
  ties to the lowest index.
* ``prefix``: the longest device hit (the engine's tree, read without
  touching it: :func:`~layerlift.engine.estimate.device_hit_tokens`), ties
  by queued tokens, then index: what cache-aware routers (SGLang's router,
  llm-d's prefix scorer) do.
* ``restore-aware``: the lowest estimated TTFT: the instance's queue (the
  estimated service seconds of what it holds) plus
  :meth:`Engine.estimate_prefill`'s ``ttft_s`` (device hit free, what the
  store holds restored at the link's cost, the rest computed); ties by
  queued tokens, then index.

Routers run on the event loop; a router decides from the state at the
moment it is asked.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple, Protocol

import numpy as np

from layerlift.engine.api import Engine
from layerlift.engine.costmodel import CostPriors
from layerlift.engine.estimate import device_hit_tokens

__all__ = ["ROUTERS", "InstanceView", "Route", "Router", "make_router"]

ROUTERS = ("round-robin", "least-loaded", "prefix", "restore-aware")


class InstanceView(Protocol):
    """What a router reads of one instance."""

    engine: Engine
    queued_tokens: int  # prompt tokens sent and not yet answered
    queued_s: float  # the estimated service seconds of those requests


class Route(NamedTuple):
    """The chosen instance and its estimated service seconds (0.0 for
    routers that do not estimate)."""

    instance: int
    est_s: float


class Router(Protocol):
    name: str

    async def route(self, tokens: np.ndarray, instances: Sequence[InstanceView]) -> Route:
        """The instance for ``tokens``; ``ValueError`` for an empty fleet."""
        ...


def _check(instances: Sequence[InstanceView]) -> None:
    if not instances:
        raise ValueError("a router needs at least one instance")


class RoundRobin:
    name = "round-robin"

    def __init__(self) -> None:
        self._next = 0

    async def route(self, tokens: np.ndarray, instances: Sequence[InstanceView]) -> Route:
        _check(instances)
        i = self._next % len(instances)
        self._next += 1
        return Route(i, 0.0)


class LeastLoaded:
    name = "least-loaded"

    async def route(self, tokens: np.ndarray, instances: Sequence[InstanceView]) -> Route:
        _check(instances)
        return Route(min(range(len(instances)), key=lambda i: instances[i].queued_tokens), 0.0)


class PrefixAware:
    name = "prefix"

    async def route(self, tokens: np.ndarray, instances: Sequence[InstanceView]) -> Route:
        _check(instances)
        hits = [device_hit_tokens(x.engine.tree, tokens) for x in instances]
        return Route(min(range(len(instances)),
                         key=lambda i: (-hits[i], instances[i].queued_tokens, i)), 0.0)


class RestoreAware:
    """``priors`` price restores and compute for engines without a learned
    cost model (``restore="always"``); see the module docstring."""

    name = "restore-aware"

    def __init__(self, priors: CostPriors | None = None) -> None:
        self.priors = priors

    async def route(self, tokens: np.ndarray, instances: Sequence[InstanceView]) -> Route:
        _check(instances)
        best: tuple[float, int, int] | None = None
        est_best = 0.0
        for i, x in enumerate(instances):
            est = await x.engine.estimate_prefill(tokens, priors=self.priors)
            key = (x.queued_s + est.ttft_s, x.queued_tokens, i)
            if best is None or key < best:
                best, est_best = key, est.ttft_s
        assert best is not None
        return Route(best[2], est_best)


def make_router(name: str, priors: CostPriors | None = None) -> Router:
    """A fresh router by name (one of :data:`ROUTERS`); ``ValueError`` otherwise."""
    if name == "round-robin":
        return RoundRobin()
    if name == "least-loaded":
        return LeastLoaded()
    if name == "prefix":
        return PrefixAware()
    if name == "restore-aware":
        return RestoreAware(priors)
    raise ValueError(f"unknown router {name!r}; choose one of {list(ROUTERS)}")
