"""What one ``lookup`` may cost SGLang's scheduler thread.

SGLang calls ``lookup`` inside ``match_prefix``, on the scheduler thread, once
per waiting request and round, decodes included. :class:`LookupGuard` runs the
store's ``exists`` on a thread of its own and bounds what the scheduler pays:

- one call: at most ``timeout_s`` (the call may go on; the next lookup does
  not queue behind it: it is a miss while the call still runs);
- a **breaker**: after a call that timed out or found the store unavailable,
  every lookup is a miss, at no cost, for ``breaker_s``; then one call probes;
- a **budget**: lookups spend from a bucket of ``timeout_s`` seconds refilled
  at ``share`` seconds per second, and are misses while it is empty (the call
  that empties it may overdraw it by at most ``timeout_s``), so over any
  interval ``T`` lookups cost the scheduler at most ``2 * timeout_s + share *
  T`` (a slow master, not a stopped one, no longer costs every round).

A miss is always safe: SGLang then computes the prefix.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout

from layerlift.linker.store_base import Store, StoreUnavailable

__all__ = ["LookupGuard"]

_log = logging.getLogger(__name__)


class LookupGuard:
    """Bounded, breaker-guarded ``exists`` calls (see the module docstring).
    Called from SGLang's scheduler thread only."""

    def __init__(self, timeout_s: float, breaker_s: float, share: float,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.timeout_s = timeout_s
        self.breaker_s = breaker_s
        self.share = share
        self._clock = clock
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="layerlift-lookup")
        self._running: Future[list[bool]] | None = None
        self._lock = threading.Lock()
        self.open_until = 0.0
        self.budget_s = timeout_s
        self._stamp = clock()
        self.trips = 0  # times the breaker opened
        self.skipped = 0  # lookups answered as a miss without asking the store
        self.spent_s = 0.0  # scheduler time spent in store calls

    def _refill(self, now: float) -> None:
        self.budget_s = min(self.timeout_s, self.budget_s + self.share * (now - self._stamp))
        self._stamp = now

    def exists(self, store: Store, keys: Sequence[str]) -> list[bool] | None:
        """The store's answer, or None (a miss): breaker open, budget spent,
        an earlier call still running, the call timed out or failed."""
        with self._lock:
            now = self._clock()
            self._refill(now)
            if now < self.open_until or self.budget_s <= 0 or (
                    self._running is not None and not self._running.done()):
                self.skipped += 1
                return None
            try:
                future = self._running = self._pool.submit(store.exists, list(keys))
            except RuntimeError:  # the pool is shut down (the linker closed)
                return None
        try:
            return future.result(timeout=self.timeout_s)
        except FutureTimeout:
            self._trip(f"the store's exists did not answer within {self.timeout_s:g} s")
            return None
        except StoreUnavailable as exc:
            self._trip(str(exc))
            return None
        except Exception as exc:  # any other failure: this lookup is a miss
            _log.warning("LayerLift lookup failed (%s: %s); treated as a miss",
                         type(exc).__name__, exc)
            return None
        finally:
            with self._lock:
                spent = self._clock() - now
                self.spent_s += spent
                self.budget_s -= spent

    def _trip(self, why: str) -> None:
        with self._lock:
            self.trips += 1
            self.open_until = self._clock() + self.breaker_s
        _log.warning("LayerLift lookup: %s; every lookup is a miss for %g s", why, self.breaker_s)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
