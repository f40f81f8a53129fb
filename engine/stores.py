"""Open the store an :class:`EngineConfig` names (and its embedded master)."""

from __future__ import annotations

import logging
import socket
from dataclasses import dataclass, replace

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


def route_source(master_address: str) -> str:
    """This machine's address on the route to the master (no packet is sent):
    the address other clients of that master reach this one at."""
    host, _, port = master_address.rpartition(":")
    host = host.strip("[]")
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    try:
        with socket.socket(family, socket.SOCK_DGRAM) as sock:
            sock.connect((host, int(port)))
            address: str = sock.getsockname()[0]
    except OSError:
        return "127.0.0.1"
    return address


def _mooncake_config(
    cfg: EngineConfig, master_address: str, metadata: str, local_hostname: str = "127.0.0.1"
) -> MooncakeConfig:
    devices = tuple(d for d in cfg.rdma_devices.split(",") if d)
    return MooncakeConfig(
        master_address=master_address,
        metadata_server=metadata,
        local_hostname=local_hostname,
        protocol=cfg.protocol,
        rdma_devices=devices,
        global_segment_size=cfg.segment_bytes,
        local_buffer_size=cfg.client_buffer_bytes,
        timeout_s=cfg.store_timeout_s,
    )


def open_store(cfg: EngineConfig) -> StoreHandle:
    """Blocking (starts processes, connects): call it in a worker thread.

    ``embedded`` starts a ``mooncake_master`` on free loopback ports, bound
    to 127.0.0.1 and without its HTTP metadata server (which would listen on
    every interface), and a client that contributes ``segment_bytes`` to it
    over "P2PHANDSHAKE"; ``mooncake://HOST:PORT`` connects to an existing
    master, advertising this machine's address on the route to it; ``memory`` is in-process. An emulated
    ``link`` wraps every fetch with a modeled NIC (benchmark).
    """
    link = parse_link(cfg.link) if cfg.link else None
    target = cfg.store_target()
    if target.kind == "memory":
        return StoreHandle(MemoryStore(), None, link)
    if target.kind == "mooncake":
        assert target.master_address is not None
        local = route_source(target.master_address)
        store = MooncakeStore(_mooncake_config(cfg, target.master_address, cfg.metadata, local))
        return StoreHandle(store, None, link)
    # A read lease of 5 s: the 50 ms test default expires under large reads (-707).
    master = EmbeddedMaster(lease_ttl_ms=5000, http_metadata=False).start()
    try:
        # the embedded master's only segment is this client's: that is the
        # store's capacity (a prefix larger than it is never offloaded)
        store = MooncakeStore(replace(
            _mooncake_config(cfg, master.master_address, master.metadata_url),
            capacity_bytes=cfg.segment_bytes))
    except BaseException:
        master.stop()
        raise
    log.info("embedded mooncake_master at %s (log: %s)", master.master_address, master.log_path)
    return StoreHandle(store, master, link)
