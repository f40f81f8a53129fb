"""Restore or recompute, per request: a cost model learned from what happened.

Restoring ``R`` tokens moves their bytes over the link, layer by layer;
computing them costs forward time. On a slow link a short prefix is cheaper
to compute, and a long one is cheaper to restore. The model estimates both
and :meth:`CostModel.decide` picks the cheaper (a :class:`Decision` says
which and why).

What it learns (exponential moving averages, starting from priors so the
first decisions are sensible):

* the link, from each restore's per-layer load times: a layer that moves
  ``x`` bytes takes ``latency + x / bandwidth``. ``observe_load`` fits that
  line by least squares over EMAs of ``x``, ``y``, ``x*x``, ``x*y`` (the
  priors enter as two pseudo-points, so one observation never gives a
  degenerate fit). ``observe_layers`` reads the load's own per-layer records
  (the lane's :class:`~layerlift.overlap.scheduler.LayerTiming`), so it
  needs nothing from whoever ran the forward;
* the forward, from each batch's per-layer compute times: seconds per
  computed token (``observe_forward``). A batch whose forward was not timed
  (a host's forward that reported no timings) teaches nothing: zero seconds
  is "not measured", never "free".

Estimates follow docs/design.md §5 for one request with per-layer load
``a`` and compute ``c`` over ``L`` layers. ``H`` (``ahead_s``) is compute
already queued on the device ahead of this batch (cross-batch prefetch: the
load runs while the batch ahead computes); a plan is priced by what it adds
to the critical path after that, ``T - H``:

* recompute: ``c_tok * (R + S)`` (S = suffix tokens computed either way);
* barrier restore: ``max(H, L * a) - H + c_tok * S``;
* overlap restore: ``max(max(H, a) + c_tok * S, L * a + c_last) - H`` with
  ``c_last = c_tok * S / L`` (the per-layer overlap bound, its forward
  starting at ``H`` at the earliest).

Exploration: once recompute has won ``explore_after`` decisions in a row
with no fresh link measurement, :meth:`CostModel.decide_plan` restores the
next plan anyway (reason ``"explore: ..."``), so a link that got faster is
noticed; with recompute winning for good, one plan in ``explore_after + 1``
restores.

Pure logic: no clocks, no engine state. Not thread-safe; call it from the
event loop.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from layerlift.engine.plan import LookupPlan
from layerlift.engine.results import Timings
from layerlift.overlap.scheduler import LayerTiming
from layerlift.pools.spec import Component, ModelSpec

__all__ = ["CostModel", "CostPriors", "Decision", "restore_bytes"]


def restore_bytes(spec: ModelSpec, d: int, b: int) -> int:
    """Bytes a restore from device boundary ``d`` to ``b`` pages moves: FULL
    pages ``[d, b)``, the SWA window ``[max(d, b - W), b)``, one checkpoint."""
    if not 0 <= d <= b:
        raise ValueError(f"need 0 <= d <= b, got d={d}, b={b}")
    if b == d:
        return 0
    swa = b - max(d, b - spec.window_pages)
    return ((b - d) * spec.page_bytes(Component.FULL) + swa * spec.page_bytes(Component.SWA)
            + spec.page_bytes(Component.MAMBA))


@dataclass(frozen=True, slots=True)
class CostPriors:
    """Starting estimates, used until timings were observed: a 1 GB/s link
    with 50 us per layer call, and 0.2 ms of forward per token (the
    ``small`` preset on one CPU core is about that)."""

    bandwidth_bytes_per_s: float = 1e9
    layer_latency_s: float = 50e-6
    compute_s_per_token: float = 2e-4

    def __post_init__(self) -> None:
        if self.bandwidth_bytes_per_s <= 0 or self.compute_s_per_token <= 0:
            raise ValueError("bandwidth_bytes_per_s and compute_s_per_token must be positive")
        if self.layer_latency_s < 0:
            raise ValueError("layer_latency_s must not be negative")


@dataclass(frozen=True, slots=True)
class Decision:
    """Whether to restore, why, and the two estimates (seconds)."""

    restore: bool
    reason: str
    est_restore_s: float
    est_compute_s: float


class CostModel:
    """Online estimates of link and compute cost for one engine.

    ``alpha`` is the weight of a new observation in every moving average
    (0 < alpha <= 1). ``num_layers`` splits a restore's bytes over layers.
    ``explore_after``: after that many recompute decisions of
    :meth:`decide_plan` in a row without a link measurement, the next plan
    restores to measure the link again (``None``: never explore).
    """

    def __init__(self, num_layers: int, priors: CostPriors | None = None,
                 alpha: float = 0.2, explore_after: int | None = 16) -> None:
        if num_layers < 1:
            raise ValueError(f"num_layers must be at least 1, got {num_layers}")
        if not 0 < alpha <= 1:
            raise ValueError(f"alpha must lie in (0, 1], got {alpha}")
        if explore_after is not None and explore_after < 1:
            raise ValueError(f"explore_after must be at least 1 (or None), got {explore_after}")
        self.num_layers, self.alpha, self.explore_after = num_layers, alpha, explore_after
        self.recompute_streak = 0  # recompute decisions since the link was last measured
        self.priors = priors or CostPriors()
        p = self.priors
        # Two pseudo-points on the prior line: 0 bytes and 1 MiB per layer.
        x0, x1 = 0.0, float(1 << 20)
        y0, y1 = p.layer_latency_s, p.layer_latency_s + x1 / p.bandwidth_bytes_per_s
        self._mx, self._my = (x0 + x1) / 2, (y0 + y1) / 2
        self._mxx, self._mxy = (x0 * x0 + x1 * x1) / 2, (x0 * y0 + x1 * y1) / 2
        self._c_tok = p.compute_s_per_token
        self.load_observations = 0
        self.forward_observations = 0

    # ---- what was learned ---------------------------------------------------------
    @property
    def bandwidth_bytes_per_s(self) -> float:
        slope = self._slope()
        return float("inf") if slope <= 0 else 1.0 / slope

    @property
    def layer_latency_s(self) -> float:
        return max(0.0, self._my - self._slope() * self._mx)

    @property
    def compute_s_per_token(self) -> float:
        return self._c_tok

    def _slope(self) -> float:
        var = self._mxx - self._mx * self._mx
        if var <= 1e-9 * max(self._mxx, 1.0):  # every observation at one size: no slope
            return 1.0 / self.priors.bandwidth_bytes_per_s
        return max(0.0, (self._mxy - self._mx * self._my) / var)

    # ---- observing -------------------------------------------------------------------
    def observe_load(self, layer_bytes: Sequence[int], layer_seconds: Sequence[float]) -> None:
        """One restore's per-layer bytes and load times (a layer's time is
        from the previous layer's landing, or the issue, to its own; layers
        that moved nothing are skipped). ``ValueError`` on mismatched lengths
        or negative values."""
        if len(layer_bytes) != len(layer_seconds):
            raise ValueError(f"{len(layer_bytes)} byte counts for {len(layer_seconds)} times")
        for x, y in zip(layer_bytes, layer_seconds, strict=True):
            if x < 0 or y < 0:
                raise ValueError("layer bytes and seconds must not be negative")
            if x == 0:
                continue
            a = self.alpha
            self._mx += a * (x - self._mx)
            self._my += a * (y - self._my)
            self._mxx += a * (x * x - self._mxx)
            self._mxy += a * (x * y - self._mxy)
            self.load_observations += 1
            self.recompute_streak = 0

    def observe_layers(self, layers: Sequence[LayerTiming]) -> None:
        """One load's per-layer records from the lane (absolute clock): a
        layer's time runs from the later of its issue and the previous
        layer's landing to its own landing (on a GPU, its copies' completion
        when recorded: what the forward waits for). Layers that failed, never
        landed or moved nothing are skipped (a load cut short still teaches
        what landed)."""
        xs: list[int] = []
        ys: list[float] = []
        last = float("-inf")
        for t in sorted(layers, key=lambda t: t.layer):
            if t.failed or t.landed <= 0 or t.nbytes <= 0:
                continue
            end = max(t.landed, t.device_done or 0.0)
            xs.append(t.nbytes)
            ys.append(max(0.0, end - max(t.issued, last)))
            last = max(last, end)
        self.observe_load(xs, ys)

    def observe_forward(self, computed_tokens: int, forward_seconds: float) -> None:
        """One forward that computed ``computed_tokens`` (all requests of the
        batch) in ``forward_seconds`` (the sum of its per-layer compute).
        ``forward_seconds == 0`` means the forward was not timed (a host's
        forward that reported nothing): nothing is learned."""
        if computed_tokens < 0 or forward_seconds < 0:
            raise ValueError("computed_tokens and forward_seconds must not be negative")
        if computed_tokens == 0 or forward_seconds == 0:
            return
        self._c_tok += self.alpha * (forward_seconds / computed_tokens - self._c_tok)
        self.forward_observations += 1

    def observe_batch(self, timings: Timings, layer_bytes: Sequence[int],
                      computed_tokens: int) -> None:
        """One batch's :class:`Timings` (shared by its results): per-layer load
        times from ``layer_landed`` (each layer from the later of the issue and
        the previous landing; layers that did not land are skipped),
        ``layer_bytes`` the bytes each layer's fetch moved for the whole batch,
        and the forward's ``layer_compute`` over ``computed_tokens`` (learned
        only when it has one entry per layer: an untimed forward teaches
        nothing)."""
        if timings.layer_landed:
            if len(layer_bytes) != len(timings.layer_landed):
                raise ValueError(f"{len(layer_bytes)} byte counts for "
                                 f"{len(timings.layer_landed)} layers")
            xs, ys, last = [], [], timings.load_issued
            for x, landed in zip(layer_bytes, timings.layer_landed, strict=True):
                if landed <= 0:
                    continue
                xs.append(x)
                ys.append(max(0.0, landed - last))
                last = max(last, landed)
            self.observe_load(xs, ys)
        if len(timings.layer_compute) == self.num_layers:
            self.observe_forward(computed_tokens, sum(timings.layer_compute))

    # ---- estimating ----------------------------------------------------------------------
    def load_seconds(self, restore_bytes: int) -> float:
        """Estimated time to land ``restore_bytes`` over all layers."""
        per_layer = restore_bytes / self.num_layers
        return self.num_layers * (self.layer_latency_s + per_layer / self.bandwidth_bytes_per_s)

    def compute_seconds(self, tokens: int) -> float:
        """Estimated forward time of ``tokens`` computed tokens (e.g. the
        batch ahead on the device, for ``ahead_s``)."""
        if tokens < 0:
            raise ValueError(f"tokens must not be negative, got {tokens}")
        return self._c_tok * tokens

    def decide_plan(self, plan: LookupPlan, *, overlap: bool = True,
                    ahead_s: float = 0.0) -> Decision:
        """The engine's decision for a plan after LOOKUP chose its boundary:
        :meth:`decide`, then exploration. Recompute decisions count into
        ``recompute_streak`` (a link measurement resets it); once it passes
        ``explore_after`` the plan restores anyway, with a reason starting
        ``"explore:"``, and the streak restarts."""
        spec = plan.spec
        d = self.decide(plan.restore_tokens,
                        restore_bytes(spec, plan.device_pages, plan.boundary),
                        len(plan.tokens) - plan.boundary * spec.page_size, overlap=overlap,
                        ahead_s=ahead_s)
        if d.restore:
            self.recompute_streak = 0
            return d
        if plan.restore_tokens == 0:
            return d
        self.recompute_streak += 1
        if self.explore_after is None or self.recompute_streak <= self.explore_after:
            return d
        self.recompute_streak = 0
        reason = (f"explore: recompute won {self.explore_after} decisions in a row without a "
                  f"fresh link measurement; restoring {plan.restore_tokens} tokens to measure "
                  f"it (estimated ~{d.est_restore_s * 1e3:.2f} ms against computing "
                  f"~{d.est_compute_s * 1e3:.2f} ms)")
        return Decision(True, reason, d.est_restore_s, d.est_compute_s)

    def decide(self, restore_tokens: int, restore_bytes: int, suffix_tokens: int, *,
               overlap: bool = True, ahead_s: float = 0.0) -> Decision:
        """Restore ``restore_tokens`` (``restore_bytes`` over the link) and
        compute ``suffix_tokens``, or compute all of them? ``ahead_s``:
        seconds of compute queued on the device before this batch's forward
        can start (a prefetched load runs during them); both options are
        priced by what they add to the critical path after that (see the
        module docstring). Ties restore (the restore also fills the device
        cache without a forward). A pure function of the estimates."""
        if min(restore_tokens, restore_bytes, suffix_tokens) < 0 or ahead_s < 0:
            raise ValueError("token and byte counts and ahead_s must not be negative")
        c = self._c_tok
        est_compute = c * (restore_tokens + suffix_tokens)
        if restore_tokens == 0:
            return Decision(False, "nothing to restore", est_compute, est_compute)
        load = self.load_seconds(restore_bytes)
        suffix = c * suffix_tokens
        if overlap:
            first_layer = load / self.num_layers
            end = max(load + suffix / self.num_layers, max(ahead_s, first_layer) + suffix)
        else:
            end = max(ahead_s, load) + suffix
        est_restore = end - ahead_s
        gbps = self.bandwidth_bytes_per_s / 1e9
        hidden = f", {ahead_s * 1e3:.2f} ms of it behind the batch ahead" if ahead_s else ""
        if est_restore <= est_compute:
            reason = (f"restore: loading {restore_tokens} tokens ({restore_bytes} B at "
                      f"{gbps:.3g} GB/s{hidden}) ~{est_restore * 1e3:.2f} ms beats computing "
                      f"them ~{est_compute * 1e3:.2f} ms")
            return Decision(True, reason, est_restore, est_compute)
        reason = (f"recompute: computing {restore_tokens} tokens ~{est_compute * 1e3:.2f} ms "
                  f"beats loading {restore_bytes} B at {gbps:.3g} GB/s{hidden} "
                  f"~{est_restore * 1e3:.2f} ms")
        return Decision(False, reason, est_restore, est_compute)
