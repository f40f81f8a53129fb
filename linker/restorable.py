"""Restorable sets: the page counts b at which every component can restore.

A KV hit of N pages is not a restorable hit of N pages: a restore must end
at a boundary b where FULL pages ``[d, b)``, the SWA trailing window
``[max(d, b - W), b)`` and a MAMBA checkpoint at exactly b are all in the
store. The set is sparse (only where a checkpoint was stored: every
``track_pages``, and branch pages), so it is kept
as a set, not a number; with tensor parallelism every rank computes its own
and the caller intersects them (SGLang #37091: ``restorable_prefix_pages``).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence

from layerlift.linker.components import LINKER_TYPES
from layerlift.linker.contract import PoolTransfer, candidate_boundaries, check_keys
from layerlift.linker.keys import KeySchema
from layerlift.pools.spec import Component, ModelSpec

__all__ = ["choose_boundary", "intersect_ranks", "restorable_boundaries"]


def restorable_boundaries(
    spec: ModelSpec,
    d: int,
    n_pages: int,
    lookup_transfers: Mapping[Component, PoolTransfer | None],
    exists: Mapping[Component, Sequence[bool]],
    *,
    schema: KeySchema | None = None,
) -> frozenset[int]:
    """Every b in ``{d} | candidate_boundaries(spec, d, n_pages)`` at which
    all components can restore from the device boundary d.

    ``exists[c][i]`` says whether the store holds entry i of
    ``lookup_transfers[c]``. A component without a lookup transfer or an
    answer restores nothing, so only d remains. With ``schema``, every
    transfer's keys are checked first (``ValueError`` for keys of another
    layout fingerprint). Raises ``ValueError`` for mismatched lengths.
    """
    cands = candidate_boundaries(spec, d, n_pages)
    available: dict[Component, set[int]] = {}
    for c in Component:
        transfer, found = lookup_transfers.get(c), exists.get(c)
        if transfer is None or found is None:
            return frozenset({d})
        if transfer.component is not c:
            raise ValueError(f"the {c.value} lookup transfer is for {transfer.component.value}")
        if len(found) != len(transfer.pages):
            raise ValueError(
                f"{c.value}: {len(found)} existence answers for {len(transfer.pages)} keys"
            )
        if schema is not None:
            check_keys(schema, transfer)
        available[c] = {p for p, ok in zip(transfer.pages, found, strict=True) if ok}
    ok = {
        b
        for b in cands
        if all(LINKER_TYPES[c].restorable_at(spec, d, b, available[c]) for c in Component)
    }
    return frozenset(ok | {d})


def intersect_ranks(sets: Iterable[frozenset[int]]) -> frozenset[int]:
    """Boundaries restorable on *every* rank. ``ValueError`` for no ranks."""
    sets = list(sets)
    if not sets:
        raise ValueError("intersect_ranks needs the restorable set of at least one rank")
    return frozenset.intersection(*sets)


def choose_boundary(boundaries: frozenset[int]) -> int:
    """The deepest restorable boundary. ``ValueError`` for an empty set
    (a set from ``restorable_boundaries`` always holds d)."""
    if not boundaries:
        raise ValueError("no restorable boundary: the set is empty")
    return max(boundaries)
