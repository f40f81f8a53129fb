"""The transfer contract between the device pools and the external store.

In the spirit of SGLang's external-linker contract (PR #37091) and its
hybrid direct linker (PR #41343):

* three transfer phases: LOOKUP (keys only: what does the store hold?),
  LOAD (store -> freshly allocated device slots), OFFLOAD (device -> store);
* three load phases: PREPARE (pin the slots), COMMIT (publish to the tree,
  keep only what the tree adopted, hand the request its COW source), ABORT
  (release everything PREPARE took; the tree is untouched);
* two hit policies: ALL_PAGES (every page of the prefix: FULL) and
  TRAILING_PAGES (only the last N pages before a boundary: SWA with N = the
  window, MAMBA with N = 1, the checkpoint at the boundary).

A :class:`PoolTransfer` names *what* moves for one component: page positions
in the prompt (MAMBA: boundary page counts b), their store keys and, for
LOAD/OFFLOAD, the device indices. Per-kind behaviour lives in
``linker/components.py``; restorable sets in ``linker/restorable.py``; one
request's load in ``linker/transaction.py``.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from enum import Enum
from typing import NamedTuple

import torch

from layerlift.linker.keys import KeySchema
from layerlift.pools.spec import Component, ModelSpec

__all__ = [
    "HitPolicy",
    "LinkRequest",
    "LinkerTransferPhase",
    "LoadPhase",
    "PoolTransfer",
    "candidate_boundaries",
    "check_keys",
]


class LinkerTransferPhase(Enum):
    """Which direction a transfer goes (see module docstring)."""

    LOOKUP = "lookup"
    LOAD = "load"
    OFFLOAD = "offload"


class LoadPhase(Enum):
    """The life cycle of one load: PREPARE, then COMMIT or ABORT."""

    PREPARE = "prepare"
    COMMIT = "commit"
    ABORT = "abort"


class HitPolicy(Enum):
    """Which pages must exist for a boundary b to be restorable."""

    ALL_PAGES = "all_pages"
    TRAILING_PAGES = "trailing_pages"


@dataclass(frozen=True, eq=False)
class PoolTransfer:
    """What moves for one component of one request or node.

    ``pages`` are absolute page positions in the prompt, ascending (MAMBA:
    boundary page counts b, whose key is the hash of page b - 1); ``keys``
    has one store key per entry; ``device_indices`` (int64, one per entry)
    is ``None`` for LOOKUP. ``trailing`` is N for TRAILING_PAGES (0 for
    ALL_PAGES). Raises ``ValueError`` on mismatched lengths.
    """

    component: Component
    pages: tuple[int, ...]
    keys: tuple[str, ...]
    device_indices: torch.Tensor | None
    hit_policy: HitPolicy
    trailing: int = 0

    def __post_init__(self) -> None:
        if len(self.pages) != len(self.keys):
            raise ValueError(f"{len(self.pages)} pages but {len(self.keys)} keys")
        if list(self.pages) != sorted(set(self.pages)):
            raise ValueError("transfer pages must be strictly ascending")
        if self.device_indices is not None and len(self.device_indices) != len(self.pages):
            raise ValueError(
                f"{len(self.pages)} pages but {len(self.device_indices)} device indices"
            )
        if (self.hit_policy is HitPolicy.TRAILING_PAGES) != (self.trailing > 0):
            raise ValueError("trailing must be positive exactly for TRAILING_PAGES")

    def __len__(self) -> int:
        return len(self.pages)

    def trimmed(self, keep_pages: Iterable[int]) -> PoolTransfer:
        """The same transfer restricted to the entries whose page is in
        ``keep_pages`` (order kept)."""
        keep = set(keep_pages)
        rows = [i for i, p in enumerate(self.pages) if p in keep]
        idx = None
        if self.device_indices is not None:
            idx = self.device_indices[torch.tensor(rows, dtype=torch.int64)].clone()
        return PoolTransfer(
            self.component,
            tuple(self.pages[i] for i in rows),
            tuple(self.keys[i] for i in rows),
            idx,
            self.hit_policy,
            self.trailing,
        )

    def indices_of(self, pages: Iterable[int]) -> torch.Tensor:
        """Device indices of the given pages (must be entries of this transfer)."""
        if self.device_indices is None:
            raise ValueError("a LOOKUP transfer has no device indices")
        pos = {p: i for i, p in enumerate(self.pages)}
        rows = [pos[p] for p in pages]
        return self.device_indices[torch.tensor(rows, dtype=torch.int64)].clone()


class LinkRequest(NamedTuple):
    """One request's view for LOOKUP and LOAD.

    ``hashes``: chained hashes of every whole page of the prompt
    (``pools.hashing.page_hashes``). ``device_pages``: the boundary d the
    device already holds (``MatchResult.boundary_pages``). ``boundary``: the
    page count b to restore to (LOAD only; ``choose_boundary``).
    """

    hashes: tuple[bytes, ...]
    device_pages: int
    boundary: int | None = None

    @property
    def n_pages(self) -> int:
        return len(self.hashes)


def candidate_boundaries(spec: ModelSpec, d: int, n_pages: int) -> list[int]:
    """Every page boundary in ``(d, n_pages]``: where a checkpoint could be,
    hence where a restore could end. Checkpoints are taken every
    ``track_pages`` and also at branch pages (where a prompt left a cached
    one off that grid), so any page boundary may hold one; LOOKUP asks the
    store about each in the same batched call."""
    if not 0 <= d <= n_pages:
        raise ValueError(f"device boundary {d} must lie in [0, {n_pages}]")
    return list(range(d + 1, n_pages + 1))


def check_keys(schema: KeySchema, transfer: PoolTransfer) -> None:
    """``ValueError`` unless every key was made by ``schema`` for the
    transfer's component: keys of another layout fingerprint, namespace,
    rank or component must never match."""
    head = f"{schema.prefix}{transfer.component.value}/{schema.rank}/"
    for key in transfer.keys:
        if not key.startswith(head):
            raise ValueError(
                f"store key {key!r} does not carry this model's fingerprint and component "
                f"(expected the prefix {head!r}); keys of another layout never match"
            )
