"""Mooncake client settings (`MooncakeConfig`), the meaning of Mooncake's
return codes (`code_error`) and the reachability check run before a client
connects (`check_reachable`)."""

from __future__ import annotations

import re
import socket
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass

from layerlift.linker.store_base import StoreError, StoreFull, StoreIOError, StoreUnavailable

__all__ = [
    "ERROR_NAMES", "EXISTS", "LEASED", "MIN_SEGMENT_BYTES", "MISSING", "NO_SPACE",
    "UNAVAILABLE_CODES", "MooncakeConfig", "check_reachable", "code_error",
]

_HOST_PORT = re.compile(r"^(?P<host>[A-Za-z0-9._-]+|\[[0-9A-Fa-f:]+\]):(?P<port>\d{1,5})$")
_METADATA_URL = re.compile(
    r"^http://(?:[A-Za-z0-9._-]+|\[[0-9A-Fa-f:]+\]):(?P<port>\d{1,5})/metadata$"
)
_DEVICE = re.compile(r"^[A-Za-z0-9_.:-]+$")
_PROTOCOLS = ("tcp", "rdma")
# The smallest segment a client can contribute: Mooncake 0.3.13's setup logs
# "Total size must be at least 16777216" and fails below it (1-15 MiB tried).
MIN_SEGMENT_BYTES = 16 << 20


def _port_ok(port: str) -> bool:
    return 0 < int(port) < 65536


@dataclass(frozen=True, slots=True)
class MooncakeConfig:
    """Connection settings of one Mooncake Store client. Validated on construction.

    - `master_address`: the master's RPC endpoint, "HOST:PORT".
    - `metadata_server`: "P2PHANDSHAKE", or the master's HTTP metadata server
      "http://HOST:PORT/metadata".
    - `protocol`: "tcp" or "rdma"; `rdma_devices` (e.g. ("mlx5_0",)) only with rdma.
    - `local_hostname`: the address other clients use to reach this one. It is
      advertised, not bound: Mooncake 0.3.13 listens for handshakes on 0.0.0.0
      and for TCP data on every interface whatever it says (`MC_TCP_BIND_ADDRESS`
      too only changes the advertised address); see the README for the remedy.
    - `global_segment_size`: bytes this client contributes to the cluster's
      pool; 0 makes it a pure client that only reads and writes others' memory.
    - `local_buffer_size`: bytes of the client's staging buffer (used for
      memory that is not registered).
    - `timeout_s`: bound on every store call.
    - `connect_timeout_s`: bound on the reachability check run before the
      client connects (`check_reachable`: resolve the master's host, open a
      TCP connection to its RPC port; the same for an HTTP metadata server).
      A name that does not resolve, a refused port or no answer fails within
      it, as StoreUnavailable naming the address.
    - `setup_timeout_s`: bound on Mooncake's own `setup` once the master
      answered. Mooncake 0.3.13's `setup` holds the GIL for its whole run, so
      the bound cannot cut it short: a master that accepts connections but
      does not answer (stopped, overloaded) keeps the interpreter for
      Mooncake's RPC timeout (30 s) per try (MC_STORE_CLIENT_SETUP_RETRIES
      tries; `layerlift.linker.mooncake_store` defaults it to 2), and the
      StoreTimeout then says how long it took.
    - `workers`: threads that run the blocking Mooncake calls.
    - `capacity_bytes`: the cluster's total segment bytes, when known (an
      embedded master: this client's segment); None: unknown.

    A client that contributes a segment (`global_segment_size > 0`) must
    contribute at least `MIN_SEGMENT_BYTES` (16 MiB): Mooncake 0.3.13 fails
    `setup` for smaller segments with an error that blames the master.

    Raises ValueError with a readable sentence for any bad field.
    """

    master_address: str
    metadata_server: str = "P2PHANDSHAKE"
    protocol: str = "tcp"
    rdma_devices: tuple[str, ...] = ()
    local_hostname: str = "127.0.0.1"
    global_segment_size: int = 512 << 20
    local_buffer_size: int = 64 << 20
    timeout_s: float = 10.0
    connect_timeout_s: float = 5.0
    setup_timeout_s: float = 30.0
    workers: int = 4
    capacity_bytes: int | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "rdma_devices", tuple(self.rdma_devices))
        match = _HOST_PORT.match(self.master_address)
        if not match or not _port_ok(match["port"]):
            raise ValueError(
                f"master_address must look like 'HOST:PORT' (e.g. '127.0.0.1:50051'), "
                f"got {self.master_address!r}."
            )
        url = _METADATA_URL.match(self.metadata_server)
        if self.metadata_server != "P2PHANDSHAKE" and (not url or not _port_ok(url["port"])):
            raise ValueError(
                "metadata_server must be 'P2PHANDSHAKE' or 'http://HOST:PORT/metadata', "
                f"got {self.metadata_server!r}."
            )
        self._check_transport()
        self._check_sizes()

    def _check_transport(self) -> None:
        if self.protocol not in _PROTOCOLS:
            raise ValueError(f"protocol must be 'tcp' or 'rdma', got {self.protocol!r}.")
        if self.rdma_devices and self.protocol != "rdma":
            raise ValueError("rdma_devices are only used with protocol='rdma'.")
        bad = [d for d in self.rdma_devices if not isinstance(d, str) or not _DEVICE.match(d)]
        if bad:
            raise ValueError(f"RDMA device names must be like 'mlx5_0', got {bad!r}.")
        if not _HOST_PORT.match(f"{self.local_hostname}:1"):
            raise ValueError(
                f"local_hostname must be a host name or address, got {self.local_hostname!r}."
            )

    def _check_sizes(self) -> None:
        for name in ("global_segment_size", "local_buffer_size"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"{name} must be a number of bytes >= 0, got {value!r}.")
        if 0 < self.global_segment_size < MIN_SEGMENT_BYTES:
            raise ValueError(
                f"global_segment_size (segment_bytes) must be 0 (a client that contributes no "
                f"memory) or at least {MIN_SEGMENT_BYTES >> 20} MiB, got "
                f"{self.global_segment_size} bytes: Mooncake cannot mount a smaller segment."
            )
        if self.capacity_bytes is not None and (
                isinstance(self.capacity_bytes, bool) or not isinstance(self.capacity_bytes, int)
                or self.capacity_bytes < 0):
            raise ValueError(f"capacity_bytes must be None or bytes >= 0, got "
                             f"{self.capacity_bytes!r}.")
        for name in ("timeout_s", "connect_timeout_s", "setup_timeout_s"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int | float) or not value > 0:
                raise ValueError(f"{name} must be a positive number of seconds, got {value!r}.")
        if isinstance(self.workers, bool) or not isinstance(self.workers, int) or self.workers < 1:
            raise ValueError(f"workers must be an integer >= 1, got {self.workers!r}.")

    @property
    def rdma_device_list(self) -> str:
        """The comma-separated device list Mooncake's `setup` expects ("" for tcp)."""
        return ",".join(self.rdma_devices)

    def endpoints(self) -> list[tuple[str, str]]:
        """What the client must reach, as (what, "HOST:PORT"): the master's RPC
        port, and the HTTP metadata server's when one is configured."""
        out = [("the Mooncake master", self.master_address)]
        url = _METADATA_URL.match(self.metadata_server)
        if url is not None:
            host_port = self.metadata_server.removeprefix("http://").removesuffix("/metadata")
            out.append(("the Mooncake metadata server", host_port))
        return out


def _resolve(host: str, port: int, timeout_s: float) -> list[tuple[int, tuple[object, ...]]]:
    """getaddrinfo bounded by `timeout_s`: it runs in a daemon thread (it
    releases the GIL; a slow resolver is left to finish there). Raises
    OSError for a name that does not resolve, TimeoutError past the bound."""
    box: list[object] = []
    done = threading.Event()

    def work() -> None:
        try:
            box.append(socket.getaddrinfo(host, port, type=socket.SOCK_STREAM))
        except OSError as exc:
            box.append(exc)
        done.set()

    threading.Thread(target=work, name="mooncake-resolve", daemon=True).start()
    if not done.wait(timeout_s):
        raise TimeoutError(f"resolving {host!r} took over {timeout_s:g} s")
    if isinstance(box[0], OSError):
        raise box[0]
    return [(family, addr) for family, _, _, _, addr in box[0]]  # type: ignore[attr-defined]


def check_reachable(what: str, address: str, timeout_s: float) -> None:
    """Resolve `address` ("HOST:PORT") and open (then close) a TCP connection
    to it, all within `timeout_s` seconds. Returns None when something
    listens there; raises StoreUnavailable (one sentence naming `what`, the
    address and the reason) when the name does not resolve, the connection is
    refused, or nothing answers in time. Blocking; sends no data."""
    host, _, port = address.rpartition(":")
    host = host.strip("[]")
    deadline = time.monotonic() + timeout_s
    bound = f"connect_timeout_s={timeout_s:g}"
    try:
        addrs = _resolve(host, int(port), timeout_s)
    except OSError as exc:
        reason = (f"no answer from the resolver within {timeout_s:g} s ({bound})"
                  if isinstance(exc, TimeoutError)
                  else f"the name {host!r} does not resolve ({exc.strerror or exc})")
        raise StoreUnavailable(f"Cannot reach {what} at {address}: {reason}.") from None
    errors: list[str] = []
    for family, addr in addrs:
        left = deadline - time.monotonic()
        if left <= 0:
            break
        try:
            with socket.socket(family, socket.SOCK_STREAM) as sock:
                sock.settimeout(left)
                sock.connect(addr)
            return
        except TimeoutError:
            errors.append(f"no answer within {timeout_s:g} s ({bound})")
        except OSError as exc:
            errors.append(exc.strerror or str(exc))
    reason = "; ".join(dict.fromkeys(errors)) or f"no answer within {timeout_s:g} s ({bound})"
    raise StoreUnavailable(
        f"Cannot reach {what} at {address}: {reason.lower()}; is it running there, and is "
        "its port open to this machine?")


# Mooncake ErrorCode values (mooncake-store/include/types.h) this backend names in messages.
ERROR_NAMES = {
    -1: "INTERNAL_ERROR",
    -200: "NO_AVAILABLE_HANDLE: the cluster is out of memory",
    -600: "INVALID_PARAMS",
    -704: "OBJECT_NOT_FOUND",
    -705: "OBJECT_ALREADY_EXISTS",
    -706: "OBJECT_HAS_LEASE",
    -707: "LEASE_EXPIRED: the read took longer than the master's --default_kv_lease_ttl",
    -800: "TRANSFER_FAIL",
    -900: "RPC_FAIL: the master is unreachable",
    -901: "RPC_TIMEOUT",
}
UNAVAILABLE_CODES = frozenset({-900, -901})
MISSING, EXISTS, LEASED, NO_SPACE = -704, -705, -706, -200


def code_error(what: str, code: int, keys: Sequence[str] = ()) -> StoreError:
    """The exception for Mooncake return code `code` of operation `what`."""
    shown = f" for key(s) {', '.join(keys[:3])}{' ...' if len(keys) > 3 else ''}" if keys else ""
    message = (
        f"Mooncake {what} failed{shown} with error {code} ({ERROR_NAMES.get(code, 'unknown')})."
    )
    if code in UNAVAILABLE_CODES:
        return StoreUnavailable(message + " Check that mooncake_master is running and reachable.")
    if code == NO_SPACE:
        return StoreFull(message)
    return StoreIOError(message)
