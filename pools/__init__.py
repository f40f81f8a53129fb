"""Device pools: model spec, byte buffers, allocators, per-layer views.

Pools: :class:`UnifiedKVPool` (FULL grow-up END | MAMBA float | SWA grow-down
END in one buffer, boundaries move with the load) and :class:`StaticKVPool`
(three fixed regions). Both implement :class:`KVPool` (``base.py``). The
generic N-sub-pool core is :class:`MultiEndedAllocator` with
:class:`SubPoolSpec`.
"""

from layerlift.pools.allocator import MultiEndedAllocator
from layerlift.pools.base import KVPool, MoveListener, PoolAccountingError, PoolError
from layerlift.pools.end_allocator import SubPoolSpec
from layerlift.pools.spec import Component, ModelSpec
from layerlift.pools.static import StaticKVPool, typical_demand
from layerlift.pools.unified import UnifiedKVPool

__all__ = [
    "Component",
    "KVPool",
    "ModelSpec",
    "MoveListener",
    "MultiEndedAllocator",
    "PoolAccountingError",
    "PoolError",
    "StaticKVPool",
    "SubPoolSpec",
    "UnifiedKVPool",
    "typical_demand",
]
