"""The old names of the staging ring, kept for the vLLM worker until it is ported.

``ScratchArena`` is a :class:`~layerlift.linker.ring.StagingRing` whose
``take(n)`` is ``acquire(n, zero=True, overflow=True)`` (a region that does
not fit now gets a registered buffer of its own instead of waiting), and
``Scratch`` is its :class:`~layerlift.linker.ring.Region`. There is no second
arena: new code uses ``linker/ring.py`` and ``linker/staged.py`` directly
(the engine's footers take theirs from ``ring_for(store)``). Delete this module
once ``layerlift/hosts/vllm/`` no longer imports it.
"""

from __future__ import annotations

from layerlift.linker.ring import Region, StagingRing
from layerlift.linker.store_base import Store

__all__ = ["Scratch", "ScratchArena"]

Scratch = Region


class ScratchArena(StagingRing):
    """A staging ring of ``nbytes`` (default 4 MiB) with the old ``take``."""

    def __init__(self, store: Store, nbytes: int = 4 << 20) -> None:
        if nbytes <= 0:
            raise ValueError(f"a scratch arena needs a positive size, got {nbytes}")
        super().__init__(store, nbytes, timeout_s=0.0)

    @property
    def nbytes(self) -> int:
        return self.capacity

    def take(self, nbytes: int) -> Region:
        """A zeroed region of ``nbytes`` bytes (>= 1); a buffer of its own when
        nothing fits now. Raises StoreError if the store refuses to register."""
        return self.acquire(nbytes, zero=True, overflow=True)
