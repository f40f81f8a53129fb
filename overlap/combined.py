"""Readiness of a batch that depends on several loads.

A batch's forward may need its own load *and* loads published by other in-flight
requests (their pages were adopted into the tree first). `CombinedReadiness` presents the
same consumer interface as `LayerReadiness`: layer `l` is ready when it is ready in every
part. It owns nothing: producers keep marking the parts.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

from .base import LayerWaitTimeout, ReadinessView, RequestId
from .readiness import DEFAULT_WAIT_TIMEOUT_S


class CombinedReadiness:
    """AND of several readiness views with the same number of layers.

    Thread-safety and exceptions are those of the parts: `wait` raises a failure already
    recorded in any part at once; otherwise it waits on the parts in order, so a failure
    recorded in a later part while an earlier one is still loading surfaces when the earlier
    one is done. `LayerWaitTimeout` when the whole wait exceeded `timeout`.
    """

    def __init__(
        self,
        parts: Sequence[ReadinessView],
        *,
        default_timeout: float = DEFAULT_WAIT_TIMEOUT_S,
    ) -> None:
        if not parts:
            raise ValueError("CombinedReadiness needs at least one readiness object")
        sizes = {p.num_layers for p in parts}
        if len(sizes) != 1:
            raise ValueError(f"all parts must have the same number of layers, got {sorted(sizes)}")
        self._parts = tuple(parts)
        self._num_layers = sizes.pop()
        self._timeout = default_timeout

    @property
    def num_layers(self) -> int:
        return self._num_layers

    @property
    def parts(self) -> tuple[ReadinessView, ...]:
        return self._parts

    def wait(
        self,
        layer: int,
        timeout: float | None = None,
        *,
        requests: frozenset[RequestId] | None = None,
        stream: Any = None,
    ) -> None:
        """Wait for `layer` in every part; one deadline covers all of them."""
        total = self._timeout if timeout is None else timeout
        if len(self._parts) == 1:
            self._parts[0].wait(layer, total, requests=requests, stream=stream)
            return
        deadline = time.monotonic() + total
        for part in self._parts:  # a known failure anywhere beats waiting on an earlier part
            if part.failed(layer, requests=requests):
                part.wait(layer, 0.0, requests=requests)  # raises its LayerLoadError
        for part in self._parts:
            # A part that is already done returns before looking at its timeout.
            try:
                part.wait(layer, deadline - time.monotonic(), requests=requests, stream=stream)
            except LayerWaitTimeout:
                raise LayerWaitTimeout(layer, total) from None

    async def ready(
        self,
        layer: int,
        *,
        requests: frozenset[RequestId] | None = None,
        timeout: float | None = None,  # noqa: ASYNC109 -- a default deadline: no wait is unbounded
    ) -> None:
        """Resolve once `layer` landed in every part; `LayerWaitTimeout` after
        `timeout` seconds in all (None: the default timeout)."""
        total = self._timeout if timeout is None else timeout
        deadline = time.monotonic() + total
        try:
            for part in self._parts:
                await part.ready(layer, requests=requests,
                                 timeout=max(0.0, deadline - time.monotonic()))
        except LayerWaitTimeout:
            raise LayerWaitTimeout(layer, total) from None

    def done(self, layer: int, *, requests: frozenset[RequestId] | None = None) -> bool:
        return all(p.done(layer, requests=requests) for p in self._parts)

    def failed(self, layer: int, *, requests: frozenset[RequestId] | None = None) -> bool:
        return any(p.failed(layer, requests=requests) for p in self._parts)

    def failed_requests(self) -> frozenset[RequestId]:
        out: frozenset[RequestId] = frozenset()
        for p in self._parts:
            out |= p.failed_requests()
        return out


def wait_all(
    readinesses: Sequence[ReadinessView],
    layer: int,
    timeout: float | None = None,
    *,
    requests: frozenset[RequestId] | None = None,
) -> None:
    """One-shot form of `CombinedReadiness(readinesses).wait(layer, timeout, requests=...)`."""
    CombinedReadiness(readinesses).wait(layer, timeout, requests=requests)
