"""Open the store an :class:`EngineConfig` names (and its embedded master):
:func:`open_store` (blocking) and :func:`open_store_owned` (async, honours
a cancellation without leaving a client or a master running)."""

from __future__ import annotations

import asyncio
import logging
import socket
import threading
from dataclasses import dataclass, replace

import anyio

from layerlift.engine.config import EngineConfig
from layerlift.engine.threads import run_owned, wait_through
from layerlift.linker.master import EmbeddedMaster
from layerlift.linker.memory_store import MemoryStore
from layerlift.linker.mooncake_config import MooncakeConfig, check_reachable
from layerlift.linker.mooncake_store import MooncakeStore
from layerlift.linker.store_base import Store
from layerlift.overlap.link import EmulatedLink, parse_link

__all__ = ["OpenCancelled", "StoreHandle", "open_store", "open_store_owned"]

log = logging.getLogger("layerlift.engine")


class OpenCancelled(Exception):
    """Raised inside :func:`open_store`'s thread when its ``cancel`` event was
    set between two steps; whatever it had started is stopped first."""


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
        connect_timeout_s=cfg.connect_timeout_s,
    )


def open_store(cfg: EngineConfig, cancel: threading.Event | None = None) -> StoreHandle:
    """Blocking (starts processes, connects): call it in a worker thread.

    ``embedded`` starts a ``mooncake_master`` on free loopback ports, bound
    to 127.0.0.1 and without its HTTP metadata server (which would listen on
    every interface), and a client that contributes ``segment_bytes`` to it
    over "P2PHANDSHAKE"; ``mooncake://HOST:PORT`` connects to an existing
    master, advertising this machine's address on the route to it, after
    checking within ``connect_timeout_s`` that the master answers
    (``StoreUnavailable`` naming the address otherwise); ``memory`` is
    in-process. An emulated ``link`` wraps every fetch with a modeled NIC
    (benchmark). ``cancel``: checked between the steps (master started,
    client connected); once set, what was started is closed and
    :class:`OpenCancelled` raised. Mooncake's own ``setup`` is one step that
    cannot be cut short (it holds the GIL).
    """
    link = parse_link(cfg.link) if cfg.link else None
    target = cfg.store_target()
    if target.kind == "memory":
        return StoreHandle(MemoryStore(), None, link)
    if target.kind == "mooncake":
        assert target.master_address is not None
        # before route_source, whose lookup of the host has no bound of its own
        check_reachable("the Mooncake master", target.master_address, cfg.connect_timeout_s)
        local = route_source(target.master_address)
        store = MooncakeStore(_mooncake_config(cfg, target.master_address, cfg.metadata, local))
        return _unless_cancelled(StoreHandle(store, None, link), cancel)
    # A read lease of 5 s: the 50 ms test default expires under large reads (-707).
    master = EmbeddedMaster(lease_ttl_ms=5000, http_metadata=False).start()
    try:
        if cancel is not None and cancel.is_set():
            raise OpenCancelled("opening the store was cancelled")
        # the embedded master's only segment is this client's: that is the
        # store's capacity (a prefix larger than it is never offloaded)
        store = MooncakeStore(replace(
            _mooncake_config(cfg, master.master_address, master.metadata_url),
            capacity_bytes=cfg.segment_bytes))
    except BaseException:
        master.stop()
        raise
    log.info("embedded mooncake_master at %s (log: %s)", master.master_address, master.log_path)
    return _unless_cancelled(StoreHandle(store, master, link), cancel)


def _unless_cancelled(handle: StoreHandle, cancel: threading.Event | None) -> StoreHandle:
    """``handle`` if ``cancel`` is not set; else close it and raise OpenCancelled."""
    if cancel is not None and cancel.is_set():
        handle.close()
        raise OpenCancelled("opening the store was cancelled")
    return handle


async def open_store_owned(cfg: EngineConfig) -> StoreHandle:
    """:func:`open_store` in a worker thread, owned like every engine thread
    (``engine/threads.py``): returns the handle, or raises what opening
    raised. A cancellation of the caller (``task.cancel()``, an
    ``asyncio.wait_for`` timeout) is held until the thread returned: the
    thread is told to stop at its next step, whatever it had started (a
    client, an embedded master) is closed, and then ``CancelledError`` is
    raised; no client or master outlives a cancelled call."""
    cancel = threading.Event()
    fut = asyncio.ensure_future(anyio.to_thread.run_sync(lambda: open_store(cfg, cancel)))
    try:
        return await wait_through(fut, on_cancel=cancel.set)
    except asyncio.CancelledError:
        # the thread may have finished its last step before it saw the event
        if fut.done() and not fut.cancelled() and fut.exception() is None:
            await run_owned(fut.result().close)
        raise
