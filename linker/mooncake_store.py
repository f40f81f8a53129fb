"""Mooncake Store backend: `MooncakeStore` (settings in `mooncake_config.py`).

`MooncakeStore` wraps `mooncake.store.MooncakeDistributedStore` behind the
`Store` protocol. Every blocking Mooncake call runs in a small pool of daemon
threads owned by the store and is awaited with the configured timeout, because
the client itself can hang when the master is gone (a hung call then raises
`StoreTimeout`, which carries the still-running call's future; its thread is
left to finish and never blocks interpreter exit).

Before a client is made, `check_reachable` resolves the master's address
and opens a TCP connection to it within `config.connect_timeout_s`: a name
that does not resolve or a port where nothing listens fails there, in one
sentence naming the address, instead of inside Mooncake's `setup` (which
holds the GIL while it retries, ~90 s by default).

Importing this module sets Mooncake's log level to errors only and its
setup retries to 2, unless the user set them (`mooncake_env.py`), and each
client's `setup` drops the two lines Mooncake prints on every start.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
import weakref
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future
from typing import Any, TypeVar

from layerlift.linker.daemon_pool import DaemonPool
from layerlift.linker.mooncake_config import (
    ERROR_NAMES,
    EXISTS,
    LEASED,
    MISSING,
    UNAVAILABLE_CODES,
    MooncakeConfig,
    check_reachable,
    code_error,
)
from layerlift.linker.mooncake_env import apply_defaults, setup_log_filter
from layerlift.linker.store_base import (
    Store,
    StoreError,
    StoreIOError,
    StoreKeyMissing,
    StoreObjectLeased,
    StoreObjectSize,
    StoreTimeout,
    StoreUnavailable,
    TensorLike,
    buffer_span,
    call_bounded,
    check_batch,
    check_ranges,
)

__all__ = ["MooncakeConfig", "MooncakeStore"]  # MooncakeConfig re-exported

_log = logging.getLogger(__name__)
_T = TypeVar("_T")

apply_defaults()  # before mooncake is imported: see mooncake_env.py

# Mooncake's ErrorCode values the ranged read tells apart (mooncake-store/include/types.h).
_INVALID_PARAMS, _LEASE_EXPIRED = -600, -707

# How many times one ranged read renews the sessions of its keys and reads
# them again. Once is enough for a read alone; with reads of the same keys
# on other threads (a load's layers in flight), a read started under the
# old lease and ending past it drops the session another thread just
# renewed (its read then answers INVALID_PARAMS once more): seen at 1 Gbit,
# where a 1 GiB load at depth 4 outlasts a 5 s lease.
RENEWALS = 3

def _release(client: Any, registered: dict[int, int], pool: DaemonPool, timeout_s: float) -> None:
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
    before connecting, the master (and an HTTP metadata server) must answer a
    TCP connect within `config.connect_timeout_s` (else StoreUnavailable
    naming it); Mooncake's `setup` is waited for `config.setup_timeout_s`
    (see `MooncakeConfig`: it holds the GIL). A master that is gone shows as
    StoreUnavailable (error -900) or StoreTimeout. `close()` waits for calls in
    flight (bounded), unregisters buffers, then closes the client; stores that
    are never closed are closed at interpreter exit. `remove` raises
    StoreObjectLeased for an object read (or checked with `exists`) within the
    master's lease TTL (`--default_kv_lease_ttl`): it stays until then.
    `get_ranges` needs a get session: call it inside `open_session(keys)`, or it
    opens and closes one itself around the call.

    A get session caches each object's replica with the master's read lease
    (``--default_kv_lease_ttl``, granted at session start, not renewed by the
    reads). The client checks the lease after each transfer: a read that
    ended past it returns LEASE_EXPIRED (its bytes may come from memory freed
    meanwhile, so they count as not read) and drops that key's session.
    `get_ranges` renews the sessions of such keys (a fresh master query: a new
    replica and lease, or StoreKeyMissing if the object went meanwhile) and
    reads them again, up to `RENEWALS` times per call (another thread's read
    ending past the old lease may drop a session just renewed): so a session
    outlives its lease, a load may take as long as its caller allows, and
    only a read longer than the lease fails (StoreIOError naming the lease). An object shorter than a slice
    asked for (the client answers INVALID_PARAMS, as it does for a key without
    a session) is told apart by the object's size from the master:
    StoreObjectSize names those keys.

    A call that times out goes on in the client's worker: its StoreTimeout
    carries it (`wait_finished()`); a call still queued is cancelled. The
    store cleans up after its own: a timed-out session start or register that
    succeeds later is ended or undone when it ends. Memory lent to a put or a
    read is the caller's to keep until `wait_finished()` returned.
    """

    def __init__(self, config: MooncakeConfig) -> None:
        try:
            from mooncake.store import MooncakeDistributedStore
        except ImportError as exc:
            raise ImportError(
                "MooncakeStore needs the Mooncake client: install LayerLift with the "
                "'cpu' extra (pip install 'layerlift[cpu]') or the 'cuda' extra on a GPU machine."
            ) from exc
        for what, address in config.endpoints():
            check_reachable(what, address, config.connect_timeout_s)
        self.config = config
        self.timeout_s = config.timeout_s
        self.capacity_bytes = config.capacity_bytes
        self._lock = threading.Lock()
        self._closed = False
        self._registered: dict[int, int] = {}
        self._session_lock = threading.Lock()
        self._sessions: Counter[str] = Counter()
        self._pool = DaemonPool(config.workers, "mooncake-store")
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
        started = time.monotonic()
        try:
            rc = self._call("setup", self._quiet_setup, timeout_s=c.setup_timeout_s)
        except StoreTimeout as exc:
            took = time.monotonic() - started
            if exc.future is not None:  # it may still connect: close that client then
                exc.future.add_done_callback(self._orphan_close())
            raise StoreTimeout(
                f"Mooncake setup with the master at {c.master_address} did not finish within "
                f"setup_timeout_s={c.setup_timeout_s:g} s (it held the interpreter for "
                f"{took:.0f} s): the master accepts connections but does not answer.",
                exc.future) from None
        if rc != 0:
            raise StoreUnavailable(
                f"Could not connect to the Mooncake master at {c.master_address} with metadata "
                f"server {c.metadata_server} (setup returned {rc}); is mooncake_master running?"
            )

    def _quiet_setup(self) -> int:
        c = self.config
        with setup_log_filter():
            rc: int = self._client.setup(
                c.local_hostname, c.metadata_server, c.global_segment_size,
                c.local_buffer_size, c.protocol, c.rdma_device_list, c.master_address)
        return rc

    def _call(self, what: str, fn: Callable[[], _T], timeout_s: float | None = None) -> _T:
        """Run `fn` on a worker thread; wait at most `timeout_s` (default: the
        store's). On a timeout the StoreTimeout carries the running call's
        future (a queued one is cancelled): see `StoreTimeout.wait_finished`."""
        timeout_s = self.timeout_s if timeout_s is None else timeout_s
        with self._lock:
            if self._closed:
                raise StoreError(f"Cannot call {what}: this MooncakeStore is closed.")
        return call_bounded(
            self._pool.submit, fn, timeout_s,
            f"Mooncake {what} did not finish within {timeout_s:g} s; the master at "
            f"{self.config.master_address} may be gone or overloaded (the call may still run).",
        )

    def register(self, buffer: TensorLike | int, nbytes: int | None = None) -> int:
        ptr, size = buffer_span(buffer, nbytes)
        try:
            rc = self._call("register_buffer", lambda: self._client.register_buffer(ptr, size))
        except StoreTimeout as exc:
            if exc.future is not None:  # it may still succeed: undo it then
                exc.future.add_done_callback(self._orphan_unregister(ptr))
            raise
        if rc != 0:
            raise code_error("register_buffer", rc)
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
            raise code_error("unregister_buffer", rc)

    def exists(self, keys: Sequence[str]) -> list[bool]:
        if not keys:
            return []
        codes: list[int] = self._call("exists", lambda: self._client.batch_is_exist(list(keys)))
        bad = [(k, c) for k, c in zip(keys, codes, strict=True) if c < 0]
        if bad:
            raise code_error("exists", bad[0][1], [k for k, _ in bad])
        return [c == 1 for c in codes]

    def put(self, keys: Sequence[str], ptrs: Sequence[int], sizes: Sequence[int]) -> None:
        check_batch(keys, ptrs, sizes)
        if not keys:
            return
        codes: list[int] = self._call(
            "put", lambda: self._client.batch_put_from(list(keys), list(ptrs), list(sizes))
        )
        bad = [(k, c) for k, c in zip(keys, codes, strict=True) if c not in (0, EXISTS)]
        if bad:
            raise code_error("put", bad[0][1], [k for k, _ in bad])

    def put_parts(
        self, keys: Sequence[str], ptrs: Sequence[Sequence[int]], sizes: Sequence[Sequence[int]]
    ) -> None:
        check_batch(keys, ptrs, sizes)
        for p, s in zip(ptrs, sizes, strict=True):
            check_batch(p, s)
        if not keys:
            return
        args = (list(keys), [list(p) for p in ptrs], [list(s) for s in sizes])
        codes: list[int] = self._call(
            "put", lambda: self._client.batch_put_from_multi_buffers(*args)
        )
        bad = [(k, c) for k, c in zip(keys, codes, strict=True) if c not in (0, EXISTS)]
        if bad:
            raise code_error("put", bad[0][1], [k for k, _ in bad])

    def get(self, keys: Sequence[str], ptrs: Sequence[int], sizes: Sequence[int]) -> list[bool]:
        check_batch(keys, ptrs, sizes)
        if not keys:
            return []
        codes: list[int] = self._call(
            "get", lambda: self._client.batch_get_into(list(keys), list(ptrs), list(sizes))
        )
        found: list[bool] = []
        for key, size, code in zip(keys, sizes, codes, strict=True):
            if code == MISSING:
                found.append(False)
            elif code == size:
                found.append(True)
            elif code >= 0:
                raise StoreObjectSize(
                    [key], f"Object {key} is {code} bytes but {size} were requested.")
            elif code == _INVALID_PARAMS:
                actual = self._sizes([key])[0]
                if actual >= 0 and actual != size:
                    raise StoreObjectSize(
                        [key], f"Object {key} is {actual} bytes but {size} were requested.")
                raise StoreIOError(
                    f"Mooncake get of {key} failed with error -600 (INVALID_PARAMS) for "
                    f"{size} bytes.")
            else:
                raise code_error("get", code, [key])
        return found

    def _sizes(self, keys: Sequence[str]) -> list[int]:
        """Each object's size from the master (negative: Mooncake's error,
        e.g. OBJECT_NOT_FOUND)."""
        client = self._client
        return self._call("get_size", lambda: [int(client.get_size(k)) for k in keys])

    def get_ranges(
        self,
        keys: Sequence[str],
        dst_ptrs: Sequence[Sequence[int]],
        sizes: Sequence[Sequence[int]],
        src_offsets: Sequence[Sequence[int]],
    ) -> None:
        check_ranges(keys, dst_ptrs, sizes, src_offsets)
        if not keys:
            return
        with self._session_lock:
            covered = all(self._sessions[k] > 0 for k in keys)
        if covered:
            self._ranged(keys, dst_ptrs, sizes, src_offsets)
            return
        with self.open_session(keys):
            try:
                self._ranged(keys, dst_ptrs, sizes, src_offsets)
            except StoreTimeout as exc:
                # The read may go on inside this session: end the session (and
                # return) only once it ended. Inside the caller's own session
                # (the engine's path) the timeout is raised at once instead.
                exc.wait_finished()
                raise

    def _ranged(
        self,
        keys: Sequence[str],
        dst_ptrs: Sequence[Sequence[int]],
        sizes: Sequence[Sequence[int]],
        src_offsets: Sequence[Sequence[int]],
    ) -> None:
        codes = self._read(keys, dst_ptrs, sizes, src_offsets)
        wants = [sum(s) for s in sizes]
        for _ in range(RENEWALS):
            stale = [i for i, (c, w) in enumerate(zip(codes, wants, strict=True))
                     if c in (_LEASE_EXPIRED, _INVALID_PARAMS) and c != w]
            if not stale or not self._renew([keys[i] for i in stale]):
                break
            again = self._read([keys[i] for i in stale], [dst_ptrs[i] for i in stale],
                               [sizes[i] for i in stale], [src_offsets[i] for i in stale])
            for i, code in zip(stale, again, strict=True):
                codes[i] = code
        failed = [(k, c, w) for k, c, w in zip(keys, codes, wants, strict=True) if c != w]
        if not failed:
            return
        if any(c in UNAVAILABLE_CODES for _, c, _ in failed):
            raise code_error("get_ranges", -900, [k for k, _, _ in failed])
        failed_keys = [k for k, _, _ in failed]
        missing = [k for k, ok in zip(failed_keys, self.exists(failed_keys), strict=True) if not ok]
        if missing:
            raise StoreKeyMissing(missing)
        expired = [k for k, c, _ in failed if c == _LEASE_EXPIRED]
        if expired:
            raise StoreIOError(
                f"Mooncake ranged read of {expired[0]} ended past the master's read lease "
                f"(--default_kv_lease_ttl) twice, in a renewed session too ({len(expired)} "
                "object(s)): one read takes longer than the lease; raise the lease above "
                "the store's timeout_s.")
        ends = {k: max(o + n for o, n in zip(offs, lens, strict=True))
                for k, offs, lens in zip(keys, src_offsets, sizes, strict=True)}
        invalid = [k for k, c, _ in failed if c == _INVALID_PARAMS]
        if invalid:
            short = [(k, n) for k, n in zip(invalid, self._sizes(invalid), strict=True)
                     if 0 <= n < ends[k]]
            if short:
                key, has = short[0]
                raise StoreObjectSize(
                    [k for k, _ in short],
                    f"Object {key} is {has} bytes, shorter than the slices read (up to byte "
                    f"{ends[key]}): truncated or foreign ({len(short)} object(s)).")
        key, code, want = failed[0]
        raise StoreIOError(
            f"Mooncake ranged read of {key} returned {code} "
            f"({ERROR_NAMES.get(code, 'bytes read') if code < 0 else 'bytes read'}) instead of "
            f"{want} bytes ({len(failed)} object(s) failed); a slice may lie outside its object."
        )

    def _read(self, keys: Sequence[str], dst_ptrs: Sequence[Sequence[int]],
              sizes: Sequence[Sequence[int]], src_offsets: Sequence[Sequence[int]]) -> list[int]:
        """One ranged read; per key the bytes read or Mooncake's error code."""
        args = (
            list(keys),
            [list(p) for p in dst_ptrs],
            [list(s) for s in sizes],
            [list(o) for o in src_offsets],
        )
        codes: list[int] = self._call(
            "get_ranges", lambda: self._client.batch_get_into_multi_buffer_ranges(*args)
        )
        return list(codes)

    def _renew(self, keys: list[str]) -> bool:
        """Start again the get sessions of ``keys`` still held by a session of
        this store (a read past the lease dropped them in the client): a
        fresh query, a new replica and lease. True when every one restarted;
        StoreKeyMissing for objects gone meanwhile."""
        with self._session_lock:
            held = list(dict.fromkeys(k for k in keys if self._sessions[k] > 0))
            if len(held) < len(set(keys)):
                return False
            try:
                codes: list[int] = self._call(
                    "session renew", lambda: self._client.batch_get_session_start(held))
            except StoreTimeout as exc:
                exc.lent = False  # the read again was not issued
                raise
        missing = [k for k, c in zip(held, codes, strict=True) if c == MISSING]
        if missing:
            raise StoreKeyMissing(missing)
        return all(c == 0 for c in codes)

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
        try:
            codes: list[int] = self._call(
                "session start", lambda: self._client.batch_get_session_start(keys)
            )
        except StoreTimeout as exc:
            if exc.future is not None:  # it may still succeed: end what it started then
                exc.future.add_done_callback(self._orphan_session_ender(keys))
            exc.lent = False  # no read was issued: the caller's memory is its own
            raise
        failed = [(k, c) for k, c in zip(keys, codes, strict=True) if c != 0]
        if not failed:
            return
        self._end_sessions([k for k, c in zip(keys, codes, strict=True) if c == 0])
        missing = [k for k, c in failed if c == MISSING]
        if missing:
            raise StoreKeyMissing(missing)
        raise code_error("session start", failed[0][1], [k for k, _ in failed])

    def _orphan_session_ender(self, keys: list[str]) -> Callable[[Future[Any]], None]:
        """Done callback of a timed-out session start: end the sessions it
        started after all (nobody holds them). Runs on the worker thread that
        made the call, so it calls the client directly, without a bound."""
        client = self._client

        def end(future: Future[Any]) -> None:
            if future.cancelled() or future.exception() is not None:
                return
            started = [k for k, c in zip(keys, future.result(), strict=True) if c == 0]
            if started and client.batch_get_session_end(started) != 0:
                _log.warning("Could not end %d Mooncake get sessions of a timed-out start.",
                             len(started))

        return end

    def _orphan_close(self) -> Callable[[Future[Any]], None]:
        """Done callback of a timed-out setup: nobody will use or close this
        client, so a setup that succeeded after all is closed at once."""
        client = self._client

        def close(future: Future[Any]) -> None:
            if not future.cancelled() and future.exception() is None and future.result() == 0:
                client.close()

        return close

    def _orphan_unregister(self, ptr: int) -> Callable[[Future[Any]], None]:
        """Done callback of a timed-out register: the caller gave up (and may
        free the memory), so a registration that succeeded later is undone."""
        client = self._client

        def undo(future: Future[Any]) -> None:
            if not future.cancelled() and future.exception() is None and future.result() == 0:
                client.unregister_buffer(ptr)

        return undo

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
        bad = [(k, c) for k, c in zip(keys, codes, strict=True) if c not in (0, MISSING, LEASED)]
        if bad:
            raise code_error("remove", bad[0][1], [k for k, _ in bad])
        leased = [k for k, c in zip(keys, codes, strict=True) if c == LEASED]
        if leased:
            raise StoreObjectLeased(leased)

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self._finalizer()
