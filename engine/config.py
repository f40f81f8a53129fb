"""Engine configuration, validated on construction."""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from layerlift.overlap.base import LoadPolicy

__all__ = ["EngineConfig", "StoreTarget"]

_MOONCAKE_URL = re.compile(r"^mooncake://(?P<host>[^:/]+):(?P<port>\d+)/?$")


@dataclass(frozen=True, slots=True)
class StoreTarget:
    """Where the store lives, parsed from ``EngineConfig.store``."""

    kind: str  # "embedded" | "memory" | "mooncake"
    master_address: str | None = None


@dataclass(frozen=True)
class EngineConfig:
    """How an :class:`~layerlift.engine.Engine` restores and computes.

    * ``store``: ``"embedded"`` (start a ``mooncake_master`` on loopback and a
      client with a segment), ``"memory"`` (in-process, for unit tests) or
      ``"mooncake://HOST:PORT"`` (an existing cluster; see ``metadata``,
      ``protocol``, ``rdma_devices``, ``segment_bytes``).
    * ``policy``: ``"overlap"`` (layer ``l`` waits for layer ``l`` only) or
      ``"barrier"`` (the forward starts when every layer has landed).
    * ``pool_bytes``: bytes of the unified device pool (FULL + SWA + MAMBA).
    * ``rank`` / ``world_size``: this engine's tensor-parallel rank; keys
      carry the rank, restorable boundaries are intersected across ranks.
    * ``max_in_flight``: layer fetches issued ahead of the forward. Each
      issue is a hand-off to a worker thread (~50-100 us on a small CPU box),
      so a deep queue keeps that cost off the forward's path.
    * ``stream_size``: under ``overlap`` on the CPU lane, layers fetched per
      worker call; each layer is still released the moment it landed.
    * ``link``: ``None`` (the store's own link) or ``"emulated:GBPS[,LAT_US]"``
      (a modeled NIC over an in-memory store; benchmark only).
    * ``restore``: ``"always"`` (restore whatever the store holds) or
      ``"auto"`` (per request, restore only when a cost model learned from
      this engine's own load and forward timings says it beats computing;
      the result's ``restore_decision`` says which and why).
    * ``verify_restores``: check every restored layer slice against the
      CRC-32 stored with it (``linker/integrity.py``); a mismatch fails that
      layer, which recomputes. Costs about 1 s of one CPU thread per GB
      restored here (``bench/results/integrity.json``); off trusts the store.
    * ``branch_checkpoints``: when a prompt leaves a cached one between two
      checkpoint boundaries, also capture the recurrent state at the branch
      page (at most one per request), so later prompts sharing the branch
      restore up to it.
    """

    store: str = "embedded"
    policy: str = "overlap"
    device: str = "cpu"
    pool_bytes: int = 64 << 20
    rank: int = 0
    world_size: int = 1
    namespace: str = "layerlift"
    metadata: str = "P2PHANDSHAKE"
    protocol: str = "tcp"
    rdma_devices: str = ""
    segment_bytes: int = 512 << 20
    client_buffer_bytes: int = 64 << 20
    store_timeout_s: float = 30.0
    max_in_flight: int = 8
    stream_size: int = 64
    group_size: int = 1
    link: str | None = None
    layer_wait_timeout_s: float = 120.0
    offload: bool = True
    branch_checkpoints: bool = True
    restore: str = "always"
    verify_restores: bool = True
    extra: dict[str, object] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.store_target()  # validates
        try:
            LoadPolicy(self.policy)
        except ValueError:
            raise ValueError(
                f"unknown policy {self.policy!r}; choose 'overlap', 'barrier' or 'groups'"
            ) from None
        if not (self.device == "cpu" or self.device.startswith("cuda")):
            raise ValueError(f"device must be 'cpu' or 'cuda[:N]', got {self.device!r}")
        if self.pool_bytes <= 0:
            raise ValueError(f"pool_bytes must be positive, got {self.pool_bytes}")
        if self.world_size < 1:
            raise ValueError(f"world_size must be at least 1, got {self.world_size}")
        if not 0 <= self.rank < self.world_size:
            raise ValueError(
                f"rank {self.rank} is out of range for world_size {self.world_size} "
                "(ranks are 0 .. world_size - 1)"
            )
        if self.protocol not in ("tcp", "rdma"):
            raise ValueError(f"protocol must be 'tcp' or 'rdma', got {self.protocol!r}")
        if self.max_in_flight < 1 or self.group_size < 1 or self.stream_size < 1:
            raise ValueError("max_in_flight, group_size and stream_size must be at least 1")
        if "/" in self.namespace or not self.namespace:
            raise ValueError(f"namespace must be a non-empty name without '/': {self.namespace!r}")
        if self.restore not in ("always", "auto"):
            raise ValueError(f"restore must be 'always' or 'auto', got {self.restore!r}")
        if self.link is not None and not self.link.startswith("emulated:"):
            raise ValueError(
                f"link must be None or 'emulated:GBPS[,LATENCY_US]', got {self.link!r}"
            )

    def store_target(self) -> StoreTarget:
        if self.store in ("embedded", "memory"):
            return StoreTarget(self.store)
        m = _MOONCAKE_URL.match(self.store)
        if m is None:
            raise ValueError(
                f"unknown store {self.store!r}; use 'embedded', 'memory' or "
                "'mooncake://HOST:PORT' (the master's RPC address)"
            )
        return StoreTarget("mooncake", f"{m['host']}:{m['port']}")
