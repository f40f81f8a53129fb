"""Store key schema: ``namespace/fingerprint.format/component/rank/pagehash``.

- ``namespace``: separates deployments or tenants sharing one store (no "/").
- ``fingerprint``: the model-layout fingerprint (model, layer layout, dtype,
  page size, ...). A different layout or dtype must never match a key, so it is
  part of every key.
- ``format``: the byte layout of the objects (`integrity.OBJECT_FORMAT`:
  layer-major page plus a per-layer checksum footer). A LayerLift that lays
  objects out differently uses another format, so it never reads old objects
  as valid.
- ``component``: the pool the object belongs to ("full", "swa", "mamba", ...).
- ``rank``: tensor-parallel rank whose shard the object holds (>= 0).
- ``pagehash``: the chained page hash in lowercase hex (from
  `layerlift.pools.hashing.page_hashes`), so a key names its whole prefix. A
  MAMBA checkpoint uses the hash of the last page before its boundary.

Example: ``prod/llama3-8b-bf16-ps64.l3/full/0/9f86d081884c7d65...``.
This module only formats keys; hashing lives in `pools/hashing.py`.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass

from layerlift.linker.integrity import OBJECT_FORMAT

_SEGMENT = re.compile(r"^[A-Za-z0-9._:+=@-]+$")


def _check_segment(what: str, value: str) -> None:
    if not isinstance(value, str) or not _SEGMENT.match(value):
        raise ValueError(
            f"The key {what} must be a non-empty string of letters, digits and ._:+=@- "
            f"(no '/' or spaces), got {value!r}."
        )


@dataclass(frozen=True, slots=True)
class KeySchema:
    """Formats store keys for one (namespace, model fingerprint, rank, object
    format). Immutable."""

    namespace: str
    fingerprint: str
    rank: int
    object_format: str = OBJECT_FORMAT

    def __post_init__(self) -> None:
        _check_segment("namespace", self.namespace)
        _check_segment("fingerprint", self.fingerprint)
        _check_segment("object format", self.object_format)
        if isinstance(self.rank, bool) or not isinstance(self.rank, int) or self.rank < 0:
            raise ValueError(f"The key rank must be an integer >= 0, got {self.rank!r}.")

    @property
    def prefix(self) -> str:
        """``namespace/fingerprint.format/`` — every key of this schema starts with it."""
        return f"{self.namespace}/{self.fingerprint}.{self.object_format}/"

    def key(self, component: str, page_hash: bytes) -> str:
        """The key of one page object (or checkpoint) of `component`.

        Raises ValueError for a bad component name or an empty/non-bytes hash.
        """
        _check_segment("component", component)
        if not isinstance(page_hash, bytes | bytearray) or not page_hash:
            raise ValueError(f"A page hash must be non-empty bytes, got {page_hash!r}.")
        return f"{self.prefix}{component}/{self.rank}/{bytes(page_hash).hex()}"

    def keys(self, component: str, hashes: Iterable[bytes]) -> list[str]:
        """`key(component, h)` for every hash, in order."""
        _check_segment("component", component)
        return [self.key(component, h) for h in hashes]
