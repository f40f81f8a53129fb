"""Engine configuration, validated on construction."""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field

from layerlift.linker.mooncake_config import MIN_SEGMENT_BYTES
from layerlift.overlap.base import LoadPolicy
from layerlift.overlap.link import parse_link

__all__ = ["EngineConfig", "StoreTarget"]

_MOONCAKE_URL = re.compile(r"^mooncake://(?P<host>[A-Za-z0-9._-]+):(?P<port>\d{1,5})/?$")
_METADATA_URL = re.compile(r"^http://[A-Za-z0-9._-]+:\d{1,5}/metadata$")
_DEVICE = re.compile(r"^(cpu|cuda(:\d+)?)$")
_DEVICES = re.compile(r"^([A-Za-z0-9_.:-]+(,[A-Za-z0-9_.:-]+)*)?$")


def _int_at_least(name: str, value: object, least: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < least:
        raise ValueError(f"{name} must be an integer >= {least}, got {value!r}")


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
    * ``store_timeout_s``: bound on every store call once connected.
    * ``connect_timeout_s``: bound on reaching a Mooncake master before its
      client connects (resolve the host, open a TCP connection to its RPC
      port): a name that does not resolve, a refused port or no answer fails
      ``Engine.start`` within it with ``StoreUnavailable`` naming the address.
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
      CRC-32C stored with it (``linker/integrity.py``); a mismatch fails that
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
    connect_timeout_s: float = 5.0
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
        """Validate every field; raises ValueError with a sentence naming it."""
        self.store_target()  # validates
        try:
            LoadPolicy(self.policy)
        except ValueError:
            raise ValueError(
                f"unknown policy {self.policy!r}; choose 'overlap', 'barrier' or 'groups'"
            ) from None
        if not isinstance(self.device, str) or not _DEVICE.match(self.device):
            raise ValueError(f"device must be 'cpu', 'cuda' or 'cuda:N', got {self.device!r}")
        if self.restore not in ("always", "auto"):
            raise ValueError(f"restore must be 'always' or 'auto', got {self.restore!r}")
        if not isinstance(self.namespace, str) or "/" in self.namespace or not self.namespace:
            raise ValueError(f"namespace must be a non-empty name without '/': {self.namespace!r}")
        self._check_counts()
        self._check_mooncake()
        self._check_rest()

    def _check_counts(self) -> None:
        _int_at_least("pool_bytes", self.pool_bytes, 1)
        _int_at_least("world_size", self.world_size, 1)
        _int_at_least("rank", self.rank, 0)
        if self.rank >= self.world_size:
            raise ValueError(
                f"rank {self.rank} is out of range for world_size {self.world_size} "
                "(ranks are 0 .. world_size - 1)"
            )
        for name in ("max_in_flight", "stream_size", "group_size"):
            _int_at_least(name, getattr(self, name), 1)
        for name in ("store_timeout_s", "connect_timeout_s", "layer_wait_timeout_s"):
            value = getattr(self, name)
            if (isinstance(value, bool) or not isinstance(value, int | float)
                    or not 0 < value < math.inf):
                raise ValueError(f"{name} must be a positive number of seconds, got {value!r}")

    def _check_mooncake(self) -> None:
        if self.protocol not in ("tcp", "rdma"):
            raise ValueError(f"protocol must be 'tcp' or 'rdma', got {self.protocol!r}")
        if self.metadata != "P2PHANDSHAKE" and not (
                isinstance(self.metadata, str) and _METADATA_URL.match(self.metadata)):
            raise ValueError("metadata must be 'P2PHANDSHAKE' or 'http://HOST:PORT/metadata', "
                             f"got {self.metadata!r}")
        if not isinstance(self.rdma_devices, str) or not _DEVICES.match(self.rdma_devices):
            raise ValueError("rdma_devices must be '' or device names separated by commas "
                             f"(e.g. 'mlx5_0,mlx5_1'), got {self.rdma_devices!r}")
        if self.rdma_devices and self.protocol != "rdma":
            raise ValueError("rdma_devices are used only with protocol='rdma'")
        _int_at_least("segment_bytes", self.segment_bytes, 0)
        _int_at_least("client_buffer_bytes", self.client_buffer_bytes, 0)
        floor = 1 if self.store == "embedded" else 0
        if 0 < self.segment_bytes < MIN_SEGMENT_BYTES or self.segment_bytes < floor:
            either = "" if floor else "0 (a client that contributes no memory) or "
            raise ValueError(
                f"segment_bytes must be {either}at least {MIN_SEGMENT_BYTES >> 20} MiB"
                f"{' (the embedded store holds only this segment)' if floor else ''}, got "
                f"{self.segment_bytes} bytes: Mooncake cannot mount a smaller segment")

    def _check_rest(self) -> None:
        if self.link is not None:
            try:
                emulated = parse_link(self.link) if isinstance(self.link, str) else None
            except ValueError:
                emulated = None
            if emulated is None:
                raise ValueError(
                    "link must be None or 'emulated:GBPS[,LATENCY_US]' (GB/s and microseconds, "
                    f"e.g. 'emulated:25,5'), got {self.link!r}")
        for name in ("offload", "branch_checkpoints", "verify_restores"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be True or False, got {getattr(self, name)!r}")
        if not isinstance(self.extra, dict) or not all(isinstance(k, str) for k in self.extra):
            raise ValueError(f"extra must be a dict with str keys, got {self.extra!r}")

    def store_target(self) -> StoreTarget:
        if self.store in ("embedded", "memory"):
            return StoreTarget(self.store)
        m = _MOONCAKE_URL.match(self.store)
        if m is None:
            raise ValueError(
                f"unknown store {self.store!r}; use 'embedded', 'memory' or "
                "'mooncake://HOST:PORT' (the master's RPC address)"
            )
        if not 0 < int(m["port"]) < 65536:
            raise ValueError(f"store {self.store!r}: the port must lie in 1 .. 65535")
        return StoreTarget("mooncake", f"{m['host']}:{m['port']}")
