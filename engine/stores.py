"""Open the store an :class:`EngineConfig` names (and its embedded master)."""

from __future__ import annotations

import logging
from dataclasses import dataclass

from layerlift.engine.config import EngineConfig
from layerlift.linker.master import EmbeddedMaster
from layerlift.linker.memory_store import MemoryStore
from layerlift.linker.mooncake_config import MooncakeConfig
from layerlift.linker.mooncake_store import MooncakeStore
from layerlift.linker.store_base import Store
from layerlift.overlap.link import EmulatedLink, parse_link

__all__ = ["StoreHandle", "open_store"]

log = logging.getLogger("layerlift.engine")


@dataclass(slots=True)
class StoreHandle:
    """A store plus what must be stopped with it. ``close()`` is idempotent."""

    store: Store
    master: EmbeddedMaster | None
    link: EmulatedLink | None

    def close(self) -> None:
        try:
            self.store.close()
        finally:
            if self.master is not None:
                self.master.stop()


def _mooncake_config(cfg: EngineConfig, master_address: str, metadata: str) -> MooncakeConfig:
    devices = tuple(d for d in cfg.rdma_devices.split(",") if d)
    return MooncakeConfig(
        master_address=master_address,
        metadata_server=metadata,
        protocol=cfg.protocol,
        rdma_devices=devices,
        global_segment_size=cfg.segment_bytes,
        local_buffer_size=cfg.client_buffer_bytes,
        timeout_s=cfg.store_timeout_s,
    )


def open_store(cfg: EngineConfig) -> StoreHandle:
    """Blocking (starts processes, connects): call it in a worker thread.

    ``embedded`` starts a ``mooncake_master`` on free loopback ports and a
    client that contributes ``segment_bytes`` to it; ``mooncake://HOST:PORT``
    connects to an existing master; ``memory`` is in-process. An emulated
    ``link`` wraps every fetch with a modeled NIC (benchmark).
    """
    link = parse_link(cfg.link) if cfg.link else None
    target = cfg.store_target()
    if target.kind == "memory":
        return StoreHandle(MemoryStore(), None, link)
    if target.kind == "mooncake":
        assert target.master_address is not None
        store = MooncakeStore(_mooncake_config(cfg, target.master_address, cfg.metadata))
        return StoreHandle(store, None, link)
    # A read lease of 5 s: the 50 ms test default expires under large reads (-707).
    master = EmbeddedMaster(lease_ttl_ms=5000).start()
    try:
        store = MooncakeStore(_mooncake_config(cfg, master.master_address, master.metadata_url))
    except BaseException:
        master.stop()
        raise
    log.info("embedded mooncake_master at %s (log: %s)", master.master_address, master.log_path)
    return StoreHandle(store, master, link)
