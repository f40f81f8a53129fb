"""What the engine hands back: per-request results and timings."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

__all__ = ["PrefillResult", "Timings"]


@dataclass(slots=True)
class Timings:
    """Wall-clock seconds, measured from the moment ``prefill`` was called.

    ``lookup``: the store lookup finished. ``load_issued``: the load
    started (its read session opening, then the per-layer fetches handed to
    the scheduler). ``forward_start``: layer 0 of the
    forward began computing (after its wait). ``layer_wait``: seconds the
    forward waited before each layer. ``layer_landed``: when each layer's
    restored bytes landed (empty without a restore). ``ttft``: the next-token
    distribution was ready.
    """

    lookup: float = 0.0
    load_issued: float = 0.0
    forward_start: float = 0.0
    layer_wait: list[float] = field(default_factory=list)
    layer_compute: list[float] = field(default_factory=list)
    layer_landed: list[float] = field(default_factory=list)
    ttft: float = 0.0

    @property
    def total_wait(self) -> float:
        return sum(self.layer_wait)


@dataclass(slots=True)
class PrefillResult:
    """One request's outcome.

    ``restored_tokens`` came from the store, ``device_hit_tokens`` were
    already on the device, ``computed_tokens`` were computed by the forward;
    they add up to the prompt length. ``recomputed_after_failure`` says the
    restore failed mid-way and the request was computed instead (its result
    is still exact). ``restore_decision`` is the cost model's reason to
    restore or compute (with ``EngineConfig(restore="auto")``; else None).
    """

    next_token_logprobs: torch.Tensor
    device_hit_tokens: int
    restored_tokens: int
    computed_tokens: int
    timings: Timings
    restorable_boundaries: tuple[int, ...] = ()
    recomputed_after_failure: bool = False
    fallback_reason: str | None = None
    restore_decision: str | None = None
