"""Mooncake Store backend: `MooncakeConfig` and `MooncakeStore`.

`MooncakeStore` wraps `mooncake.store.MooncakeDistributedStore` behind the
`Store` protocol. Every blocking Mooncake call runs in a small pool of daemon
threads owned by the store and is awaited with the configured timeout, because
the client itself can hang when the master is gone (a hung call then raises
`StoreTimeout`; its thread is left to finish and never blocks interpreter exit).

Mooncake logs through glog to stderr. This module never touches `os.environ`;
set `GLOG_minloglevel=2` (errors only) or `3` before starting Python to quiet it.
"""

from __future__ import annotations

import contextlib
import logging
import queue
import re
import threading
import weakref
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass
from typing import Any, TypeVar

from layerlift.linker.store_base import (
    Store,
    StoreError,
    StoreIOError,
    StoreKeyMissing,
    StoreTimeout,
    StoreUnavailable,
    TensorLike,
    buffer_span,
    check_batch,
)

_log = logging.getLogger(__name__)
_T = TypeVar("_T")

_HOST_PORT = re.compile(r"^(?P<host>[A-Za-z0-9._-]+|\[[0-9A-Fa-f:]+\]):(?P<port>\d{1,5})$")
_METADATA_URL = re.compile(
    r"^http://(?:[A-Za-z0-9._-]+|\[[0-9A-Fa-f:]+\]):(?P<port>\d{1,5})/metadata$"
)
_DEVICE = re.compile(r"^[A-Za-z0-9_.:-]+$")
_PROTOCOLS = ("tcp", "rdma")


def _port_ok(port: str) -> bool:
    return 0 < int(port) < 65536


@dataclass(frozen=True, slots=True)
class MooncakeConfig:
    """Connection settings of one Mooncake Store client. Validated on construction.

    - `master_address`: the master's RPC endpoint, "HOST:PORT".
    - `metadata_server`: "P2PHANDSHAKE", or the master's HTTP metadata server
      "http://HOST:PORT/metadata".
    - `protocol`: "tcp" or "rdma"; `rdma_devices` (e.g. ("mlx5_0",)) only with rdma.
    - `local_hostname`: the address other clients use to reach this one.
    - `global_segment_size`: bytes this client contributes to the cluster's
      pool; 0 makes it a pure client that only reads and writes others' memory.
    - `local_buffer_size`: bytes of the client's staging buffer (used for
      memory that is not registered).
    - `timeout_s`: bound on every store call; `setup_timeout_s`: bound on the
      initial connection (a client cannot reach a dead master for ~90 s).
    - `workers`: threads that run the blocking Mooncake calls.

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
    setup_timeout_s: float = 30.0
    workers: int = 4

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
        for name in ("timeout_s", "setup_timeout_s"):
            value = getattr(self, name)
            if not isinstance(value, int | float) or not value > 0:
                raise ValueError(f"{name} must be a positive number of seconds, got {value!r}.")
        if isinstance(self.workers, bool) or not isinstance(self.workers, int) or self.workers < 1:
            raise ValueError(f"workers must be an integer >= 1, got {self.workers!r}.")

    @property
    def rdma_device_list(self) -> str:
        """The comma-separated device list Mooncake's `setup` expects ("" for tcp)."""
        return ",".join(self.rdma_devices)


# Mooncake ErrorCode values (mooncake-store/include/types.h) this backend names in messages.
_ERROR_NAMES = {
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
_UNAVAILABLE_CODES = frozenset({-900, -901})
_MISSING, _EXISTS, _LEASED = -704, -705, -706


def _code_error(what: str, code: int, keys: Sequence[str] = ()) -> StoreError:
    """The exception for Mooncake return code `code` of operation `what`."""
    shown = f" for key(s) {', '.join(keys[:3])}{' ...' if len(keys) > 3 else ''}" if keys else ""
    message = (
        f"Mooncake {what} failed{shown} with error {code} ({_ERROR_NAMES.get(code, 'unknown')})."
    )
    if code in _UNAVAILABLE_CODES:
        return StoreUnavailable(message + " Check that mooncake_master is running and reachable.")
    return StoreIOError(message)


class _DaemonPool:
    """Fixed daemon threads running submitted callables in FIFO order.

    Daemon threads, unlike `ThreadPoolExecutor`'s, never hold up interpreter
    exit when a Mooncake call hangs.
    """

    def __init__(self, workers: int, name: str) -> None:
        self._queue: queue.SimpleQueue[tuple[Future[Any], Callable[[], Any]] | None] = (
            queue.SimpleQueue()
        )
        self._idle = threading.Condition()
        self._pending = 0  # calls submitted and not finished, hung ones included
        self._threads = [
            threading.Thread(target=self._run, name=f"{name}-{i}", daemon=True)
            for i in range(workers)
        ]
        for thread in self._threads:
            thread.start()

    def submit(self, fn: Callable[[], _T]) -> Future[_T]:
        future: Future[_T] = Future()
        with self._idle:
            self._pending += 1
        self._queue.put((future, fn))
        return future

    def wait_idle(self, timeout_s: float | None) -> bool:
        """Wait until no submitted call is queued or running; False on timeout."""
        with self._idle:
            return self._idle.wait_for(lambda: self._pending == 0, timeout_s)

    def _run(self) -> None:
        while (item := self._queue.get()) is not None:
            future, fn = item
            if not future.set_running_or_notify_cancel():
                continue
            try:
                future.set_result(fn())
            except BaseException as exc:  # handed to the waiting caller
                future.set_exception(exc)
            finally:
                with self._idle:
                    self._pending -= 1
                    self._idle.notify_all()

    def stop(self) -> None:
        """Let every thread exit once the queued work is done. Does not wait."""
        for _ in self._threads:
            self._queue.put(None)


def _release(client: Any, registered: dict[int, int], pool: _DaemonPool, timeout_s: float) -> None:
    """Finalizer body: once no call runs, unregister buffers and close the client.

    Closing the client while a (hung) call still runs in it crashes the
    process, so the close waits for the pool to drain, in a daemon thread; the
    caller waits at most `timeout_s` and then leaves it closing in the background.
    """

    def work() -> None:
        pool.wait_idle(None)
        pool.stop()
        for ptr in list(registered):
            rc = client.unregister_buffer(ptr)
            if rc != 0:
                _log.warning("Mooncake unregister_buffer(%#x) returned %d while closing.", ptr, rc)
        registered.clear()
        client.close()

    thread = threading.Thread(target=work, name="mooncake-close", daemon=True)
    thread.start()
    thread.join(timeout_s)
    if thread.is_alive():
        _log.warning(
            "Closing the Mooncake client took over %.1f s (a call may hang on a lost master); "
            "it goes on closing in the background.",
            timeout_s,
        )


class MooncakeStore(Store):
    """`Store` over a Mooncake Store client (see `Store` for the shared contract).

    Thread-safe. Every call is bounded by `config.timeout_s` (StoreTimeout);
    the connection by `config.setup_timeout_s`. A master that is gone shows as
    StoreUnavailable (error -900) or StoreTimeout. `close()` waits for calls in
    flight (bounded), unregisters buffers, then closes the client; stores that
    are never closed are closed at interpreter exit. `remove` is best effort: an
    object read within the master's lease TTL (`--default_kv_lease_ttl`) stays.
    `get_ranges` needs a get session: call it inside `open_session(keys)`, or it
    opens and closes one itself around the call.
    """

    def __init__(self, config: MooncakeConfig) -> None:
        try:
            from mooncake.store import MooncakeDistributedStore
        except ImportError as exc:
            raise ImportError(
                "MooncakeStore needs the Mooncake client: install LayerLift with the "
                "'cpu' extra (pip install 'layerlift[cpu]') or the 'cuda' extra on a GPU machine."
            ) from exc
        self.config = config
        self.timeout_s = config.timeout_s
        self._lock = threading.Lock()
        self._closed = False
        self._registered: dict[int, int] = {}
        self._session_lock = threading.Lock()
        self._sessions: Counter[str] = Counter()
        self._pool = _DaemonPool(config.workers, "mooncake-store")
        self._client = MooncakeDistributedStore()
        self._finalizer = weakref.finalize(
            self, _release, self._client, self._registered, self._pool, config.timeout_s
        )
        try:
            self._setup()
        except BaseException:
            self._closed = True
            self._finalizer.detach()
            self._pool.stop()
            raise

    def _setup(self) -> None:
        c = self.config
        rc = self._call(
            "setup",
            lambda: self._client.setup(
                c.local_hostname,
                c.metadata_server,
                c.global_segment_size,
                c.local_buffer_size,
                c.protocol,
                c.rdma_device_list,
                c.master_address,
            ),
            timeout_s=c.setup_timeout_s,
        )
        if rc != 0:
            raise StoreUnavailable(
                f"Could not connect to the Mooncake master at {c.master_address} with metadata "
                f"server {c.metadata_server} (setup returned {rc}); is mooncake_master running?"
            )

    def _call(self, what: str, fn: Callable[[], _T], timeout_s: float | None = None) -> _T:
        """Run `fn` on a worker thread; wait at most `timeout_s` (default: the store's)."""
        timeout_s = self.timeout_s if timeout_s is None else timeout_s
        with self._lock:
            if self._closed:
                raise StoreError(f"Cannot call {what}: this MooncakeStore is closed.")
        try:
            return self._pool.submit(fn).result(timeout_s)
        except FutureTimeout:
            raise StoreTimeout(
                f"Mooncake {what} did not finish within {timeout_s:g} s; the master at "
                f"{self.config.master_address} may be gone or overloaded."
            ) from None

    def register(self, buffer: TensorLike | int, nbytes: int | None = None) -> int:
        ptr, size = buffer_span(buffer, nbytes)
        rc = self._call("register_buffer", lambda: self._client.register_buffer(ptr, size))
        if rc != 0:
            raise _code_error("register_buffer", rc)
        with self._lock:
            self._registered[ptr] = size
        return ptr

    def unregister(self, ptr: int) -> None:
        with self._lock:
            if ptr not in self._registered:
                raise StoreError(f"Memory at {ptr:#x} is not registered with this store.")
        rc = self._call("unregister_buffer", lambda: self._client.unregister_buffer(ptr))
        with self._lock:
            self._registered.pop(ptr, None)
        if rc != 0:
            raise _code_error("unregister_buffer", rc)

    def exists(self, keys: Sequence[str]) -> list[bool]:
        if not keys:
            return []
        codes: list[int] = self._call("exists", lambda: self._client.batch_is_exist(list(keys)))
        bad = [(k, c) for k, c in zip(keys, codes, strict=True) if c < 0]
        if bad:
            raise _code_error("exists", bad[0][1], [k for k, _ in bad])
        return [c == 1 for c in codes]

    def put(self, keys: Sequence[str], ptrs: Sequence[int], sizes: Sequence[int]) -> None:
        check_batch(keys, ptrs, sizes)
        if not keys:
            return
        codes: list[int] = self._call(
            "put", lambda: self._client.batch_put_from(list(keys), list(ptrs), list(sizes))
        )
        bad = [(k, c) for k, c in zip(keys, codes, strict=True) if c not in (0, _EXISTS)]
        if bad:
            raise _code_error("put", bad[0][1], [k for k, _ in bad])

    def get(self, keys: Sequence[str], ptrs: Sequence[int], sizes: Sequence[int]) -> list[bool]:
        check_batch(keys, ptrs, sizes)
        if not keys:
            return []
        codes: list[int] = self._call(
            "get", lambda: self._client.batch_get_into(list(keys), list(ptrs), list(sizes))
        )
        found: list[bool] = []
        for key, size, code in zip(keys, sizes, codes, strict=True):
            if code == _MISSING:
                found.append(False)
            elif code == size:
                found.append(True)
            elif code >= 0:
                raise StoreIOError(f"Object {key} is {code} bytes but {size} were requested.")
            elif code == -600:
                raise StoreIOError(
                    f"Mooncake get of {key} failed with error -600 (INVALID_PARAMS): the object "
                    f"is most likely larger than the {size} bytes requested."
                )
            else:
                raise _code_error("get", code, [key])
        return found

    def get_ranges(
        self,
        keys: Sequence[str],
        dst_ptrs: Sequence[Sequence[int]],
        sizes: Sequence[Sequence[int]],
        src_offsets: Sequence[Sequence[int]],
    ) -> None:
        check_batch(keys, dst_ptrs, sizes, src_offsets)
        for key, p, s, o in zip(keys, dst_ptrs, sizes, src_offsets, strict=True):
            check_batch(p, s, o)
            if not p:
                raise ValueError(f"get_ranges: no slices given for {key}.")
        if not keys:
            return
        with self._session_lock:
            covered = all(self._sessions[k] > 0 for k in keys)
        if covered:
            self._ranged(keys, dst_ptrs, sizes, src_offsets)
            return
        with self.open_session(keys):
            self._ranged(keys, dst_ptrs, sizes, src_offsets)

    def _ranged(
        self,
        keys: Sequence[str],
        dst_ptrs: Sequence[Sequence[int]],
        sizes: Sequence[Sequence[int]],
        src_offsets: Sequence[Sequence[int]],
    ) -> None:
        args = (
            list(keys),
            [list(p) for p in dst_ptrs],
            [list(s) for s in sizes],
            [list(o) for o in src_offsets],
        )
        codes: list[int] = self._call(
            "get_ranges", lambda: self._client.batch_get_into_multi_buffer_ranges(*args)
        )
        failed = [(k, c, sum(s)) for k, c, s in zip(keys, codes, sizes, strict=True) if c != sum(s)]
        if not failed:
            return
        if any(c in _UNAVAILABLE_CODES for _, c, _ in failed):
            raise _code_error("get_ranges", -900, [k for k, _, _ in failed])
        failed_keys = [k for k, _, _ in failed]
        missing = [k for k, ok in zip(failed_keys, self.exists(failed_keys), strict=True) if not ok]
        if missing:
            raise StoreKeyMissing(missing)
        key, code, want = failed[0]
        raise StoreIOError(
            f"Mooncake ranged read of {key} returned {code} "
            f"({_ERROR_NAMES.get(code, 'bytes read') if code < 0 else 'bytes read'}) instead of "
            f"{want} bytes ({len(failed)} object(s) failed); a slice may lie outside its object."
        )

    @contextlib.contextmanager
    def _session(self, keys: tuple[str, ...]) -> Iterator[None]:
        unique = tuple(dict.fromkeys(keys))
        with self._session_lock:
            self._start_sessions([k for k in unique if self._sessions[k] == 0])
            self._sessions.update(unique)
        try:
            yield
        finally:
            with self._session_lock:
                self._sessions.subtract(unique)
                ended = [k for k in unique if self._sessions[k] <= 0]
                for key in ended:
                    del self._sessions[key]
                self._end_sessions(ended)

    def _start_sessions(self, keys: list[str]) -> None:
        """Start Mooncake get sessions (caller holds `_session_lock`); all or nothing."""
        if not keys:
            return
        codes: list[int] = self._call(
            "session start", lambda: self._client.batch_get_session_start(keys)
        )
        failed = [(k, c) for k, c in zip(keys, codes, strict=True) if c != 0]
        if not failed:
            return
        self._end_sessions([k for k, c in zip(keys, codes, strict=True) if c == 0])
        missing = [k for k, c in failed if c == _MISSING]
        if missing:
            raise StoreKeyMissing(missing)
        raise _code_error("session start", failed[0][1], [k for k, _ in failed])

    def _end_sessions(self, keys: list[str]) -> None:
        """End sessions, best effort: a failure is logged, never raised (runs in `finally`)."""
        if not keys:
            return
        try:
            rc = self._call("session end", lambda: self._client.batch_get_session_end(keys))
        except StoreError as exc:
            _log.warning("Could not end a Mooncake get session over %d keys: %s", len(keys), exc)
            return
        if rc != 0:
            _log.warning("Mooncake batch_get_session_end returned %d for %d keys.", rc, len(keys))

    def remove(self, keys: Sequence[str]) -> None:
        if not keys:
            return
        codes: list[int] = self._call("remove", lambda: self._client.batch_remove(list(keys)))
        bad = [(k, c) for k, c in zip(keys, codes, strict=True) if c not in (0, _MISSING, _LEASED)]
        if bad:
            raise _code_error("remove", bad[0][1], [k for k, _ in bad])

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self._finalizer()
