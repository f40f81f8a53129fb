"""One store read at a time, the lowest layer first: a load's reads in layer order.

A load keeps ``depth`` layers in flight so that each layer's work around its
read (planning the ranges, verifying the CRCs, landing) overlaps the others'
reads. Left alone, those ``depth`` reads share the transfer and land
together, about ``depth`` reads' time after the load's start, so the
forward's first layer waits for four. A :class:`ReadOrder` shared by a
load's readers lets one read call run at a time and, when it returns, hands
the store to the lowest layer waiting: the first layer lands after about one
read's time while the layers behind it prepare and verify.

The price is the store's idle time between one call's end and the next
call's start (a thread's wake-up and the next call's set-up): measured inside
SGLang at a real layout on two cores (``docs/guide/sglang.md``, "Reads in
layer order"), the first layer landed at 33-41 ms instead of 66-90, which
made the forward faster where a layer's compute outlasts its read, and the
whole load about a tenth slower where the transfer bounds it.

Whether it pays is a property of the forward, not of the load, so a host
lets the last load decide the next one's (:func:`order_pays`, SGLang's
``ordered_reads: "auto"``, its default): where the forward's compute of a
layer outlasts a layer's read, only the first layer's wait is left to win;
where it does not, the transfer bounds the load and reads as they come are
faster.

It is only a hint to the order of calls, never a condition of a result: a
reader that waited ``patience_s`` (the store's per-call bound: the call it
waits behind should have returned by then) reads beside the others, as
without it. It holds no memory and no store state; an exception or a timeout
in a read releases the turn as it leaves. Thread-safe.
"""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager

__all__ = ["PAYS_MARGIN", "ReadOrder", "order_pays"]

# How much longer than a layer's read the forward's compute of a layer must
# be for reads in turn to pay: they slow the transfer by up to a tenth
# (``docs/guide/sglang.md``, "Reads in layer order"), and a forward that
# computes just longer than a read would then wait for every layer again.
PAYS_MARGIN = 1.25


def order_pays(asks: Sequence[tuple[float, float] | None], read_s: float) -> bool | None:
    """Whether a load like the last one should read in turn, from what its
    forward did: ``asks[layer]`` is when the forward first asked for the
    layer and when that wait returned (None: never asked, or nothing to
    read); ``read_s`` the load's time a layer (its last landing after its
    start, over its layers). The forward's compute of a layer is the time
    from one wait's return to the next layer's ask (the median over the
    layers); reads in turn pay when it is at least :data:`PAYS_MARGIN` times
    ``read_s``: then only the first layer's wait is left to win. A forward
    that asks for every layer at once (a whole-batch wait) computes nothing
    between them: no. None (no verdict) when no two consecutive layers were
    asked for or ``read_s`` is not positive."""
    gaps = sorted(b[0] - a[1] for a, b in itertools.pairwise(asks)
                  if a is not None and b is not None)
    if not gaps or not read_s > 0:
        return None
    return gaps[len(gaps) // 2] >= PAYS_MARGIN * read_s


class ReadOrder:
    """Grants one read call at a time, the lowest waiting layer first.

    ``turn(layer)`` is a context manager around one store call. Waiting is
    bounded by ``patience_s``; after it the caller reads without the turn.
    ``granted``/``impatient`` count the turns given and the waits given up
    (for the benchmarks and tests)."""

    def __init__(self, patience_s: float) -> None:
        if not patience_s > 0:
            raise ValueError(f"a read order needs a positive patience in seconds, got "
                             f"{patience_s!r}")
        self.patience_s = patience_s
        self._cond = threading.Condition()
        self._busy = False  # a read holds the turn
        self._waiting: list[int] = []  # the layers waiting for the turn (at most depth)
        self.granted = 0
        self.impatient = 0

    @contextmanager
    def turn(self, layer: int) -> Iterator[None]:
        owned = self._acquire(layer)
        try:
            yield
        finally:
            if owned:
                with self._cond:
                    self._busy = False
                    self._cond.notify_all()

    def wait_for_waiters(self, n: int, timeout_s: float) -> bool:
        """Block until at least ``n`` callers wait for the turn (at most
        ``timeout_s``); whether they do. For tests and benchmarks that order
        readers by their arrival."""
        with self._cond:
            return self._cond.wait_for(lambda: len(self._waiting) >= n, timeout_s)

    def _acquire(self, layer: int) -> bool:
        """True with the turn; False when the wait outlasted ``patience_s``."""
        deadline = time.monotonic() + self.patience_s
        with self._cond:
            self._waiting.append(layer)
            self._cond.notify_all()  # for `wait_for_waiters`
            try:
                while self._busy or min(self._waiting) != layer:
                    left = deadline - time.monotonic()
                    if left <= 0:
                        self.impatient += 1
                        return False
                    self._cond.wait(left)
                self._busy = True
                self.granted += 1
                return True
            finally:
                self._waiting.remove(layer)
                self._cond.notify_all()  # the lowest waiter may have changed
