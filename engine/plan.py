"""One request's restore plan: what the device holds, what the store holds,
and where the restore will end."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import numpy as np

from layerlift.linker.contract import PoolTransfer
from layerlift.linker.restorable import choose_boundary, intersect_ranks
from layerlift.pools.spec import Component, ModelSpec
from layerlift.pools.tree import MatchResult

__all__ = ["LookupPlan", "check_plans", "take_plans"]


@dataclass(eq=False)
class LookupPlan:
    """The outcome of LOOKUP for one request (``Engine.lookup``).

    ``device_pages`` (d): boundary already on the device (its node is locked
    until the plan is released). ``restorable``: every page count at which
    FULL, the SWA window and a MAMBA checkpoint can all restore (always
    holds d; intersected across ranks). ``boundary`` (b >= d): the chosen
    one; ``b > d`` means pages ``[d, b)`` will be restored from the store.
    ``fallback_reason`` says why a restore was dropped (store unavailable,
    allocation failure, a failed load), if it was.
    """

    request_id: int
    tokens: np.ndarray
    hashes: tuple[bytes, ...]
    match: MatchResult
    spec: ModelSpec
    restorable: frozenset[int] = frozenset()
    boundary: int = 0
    lookup: dict[Component, PoolTransfer | None] = field(default_factory=dict)
    fallback_reason: str | None = None
    decision: str | None = None  # the cost model's word (restore="auto")
    lookup_time: float = 0.0
    pins: list[tuple[Component, object]] = field(default_factory=list)
    released: bool = False
    owner: object = field(default=None, repr=False)  # the engine context that made it
    taken: bool = False  # a batch took it (load or prefill): a plan is loaded once

    @property
    def device_pages(self) -> int:
        return self.match.boundary_pages

    @property
    def usable_pages(self) -> int:
        """Pages a restore may cover: at least one token must be computed."""
        return (len(self.tokens) - 1) // self.spec.page_size

    @property
    def device_hit_tokens(self) -> int:
        return self.device_pages * self.spec.page_size

    @property
    def restore_tokens(self) -> int:
        return (self.boundary - self.device_pages) * self.spec.page_size

    @property
    def restores(self) -> bool:
        return self.boundary > self.device_pages

    def restrict_to(self, other_ranks: Iterable[frozenset[int]]) -> None:
        """Intersect this rank's restorable set with the other ranks' (tensor
        parallelism: a restore must end where every rank can restore) and
        choose the deepest common boundary. Call before ``Engine.load``:
        ``ValueError`` for a plan a batch has taken (its pages and restore
        slots are sized for the boundary it had)."""
        if self.taken:
            raise ValueError(f"plan {self.request_id} was loaded: restrict_to() must come "
                             "before Engine.load (its batch's pages are sized for the "
                             "boundary it had then)")
        common = intersect_ranks([self.restorable, *other_ranks])
        if not common:  # the plan is left as it was: still loadable at its own boundary
            raise ValueError("the ranks share no restorable boundary, not even the device hit")
        self.restorable = common
        self.boundary = choose_boundary(common)

    def check_loadable(self, owner: object) -> None:
        """``ValueError`` unless ``owner`` (an engine's context) made this
        plan and it is still live: not released, not loaded before. A plan
        whose handle finished is released; its pages may hold other data."""
        if self.owner is not owner:
            raise ValueError(f"plan {self.request_id} was made by another engine: "
                             "load a plan with the engine whose lookup() made it")
        if self.taken:
            raise ValueError(f"plan {self.request_id} was loaded already: a plan is loaded "
                             "once; call lookup() again for a new one")
        if self.released:
            raise ValueError(f"plan {self.request_id} was released: its device pages may "
                             "hold other data now; call lookup() again for a new one")

    def drop_restore(self, reason: str) -> None:
        """Compute from the device boundary instead of restoring. Call before
        ``Engine.load``: ``ValueError`` for a plan a batch has taken (its
        pages are sized for the boundary it had)."""
        if self.taken:
            raise ValueError(f"plan {self.request_id} was loaded: drop_restore() must come "
                             "before Engine.load (its batch's pages are sized for the "
                             "boundary it had then)")
        self.fall_back(reason)

    def fall_back(self, reason: str) -> None:
        """What the engine does to a plan it has taken (a restore that does
        not fit, a failed or refused one): compute from the device boundary."""
        self.boundary = self.device_pages
        self.fallback_reason = reason


def take_plans(plans: Sequence[LookupPlan], owner: object) -> None:
    """:func:`check_plans`, then mark every plan taken, with no await
    between: from here on the plans are the caller's load (``release_plan``
    and a second ``load`` refuse them); the load releases them on every
    failure path."""
    check_plans(plans, owner)
    for plan in plans:
        plan.taken = True


def check_plans(plans: Sequence[LookupPlan], owner: object) -> None:
    """``ValueError`` for what ``Engine.load`` refuses: no plans, a plan
    listed twice, or one that is not live for ``owner`` (see
    :meth:`LookupPlan.check_loadable`)."""
    if not plans:
        raise ValueError("load() needs at least one plan from lookup()")
    seen: set[int] = set()
    for plan in plans:
        if not isinstance(plan, LookupPlan):
            raise ValueError(f"load() takes plans from lookup(), got {type(plan).__name__}")
        if id(plan) in seen:
            raise ValueError(f"plan {plan.request_id} is listed twice: a plan is loaded once")
        seen.add(id(plan))
        plan.check_loadable(owner)
