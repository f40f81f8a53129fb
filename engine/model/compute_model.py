"""How long one prefill layer takes on a device: the compute model behind
:class:`~layerlift.engine.model.simulated.SimulatedModel`.

Two kinds of model, one interface (:class:`ComputeModel.layer_seconds`):

* :class:`RooflineCompute` - an :class:`Architecture` (layer kinds and
  widths from a published config) on a :class:`DeviceProfile` (published
  peak figures and a stated utilisation). Per cache layer and per batch:
  ``max(flops / (peak * util), bytes / (hbm * mem_util)) + launch_s``. The
  flops are the projections, the MLP (or the active MoE experts), attention
  over the context (FULL) or over the window (SWA) and the recurrent scan
  (MAMBA), all per new token; the bytes are the weights the batch touches
  plus the cached KV / state it reads: the floor that keeps small,
  memory-bound batches from looking free.
* :class:`FittedCompute` - per layer kind ``a + b * tokens + c * pairs``
  (``pairs`` = query-key pairs attended), fitted by least squares to the
  reference model's own per-layer timings on this machine
  (``bench/calibrate.py``): the ``cpu-measured`` profile.

Token counts passed in are *real* tokens (the simulated model multiplies
its tokens by its token scale first). Pure arithmetic: no clocks, no state.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from layerlift.pools.spec import Component

__all__ = [
    "DEVICES",
    "MAX_WEIGHT_SHARE",
    "UTIL",
    "Architecture",
    "ComputeModel",
    "DeviceProfile",
    "FittedCompute",
    "KindFit",
    "MoE",
    "Recurrent",
    "RooflineCompute",
    "SeqWork",
    "attention_pairs",
]


@dataclass(frozen=True, slots=True)
class SeqWork:
    """One request's share of a prefill: ``prefix`` tokens already cached,
    ``new`` tokens computed now (real tokens)."""

    prefix: int
    new: int

    def __post_init__(self) -> None:
        if self.prefix < 0 or self.new < 1:
            raise ValueError(f"need prefix >= 0 and new >= 1, got {self.prefix}, {self.new}")


def attention_pairs(prefix: int, new: int, window: int | None = None) -> int:
    """Query-key pairs of ``new`` causal queries at positions ``prefix ..
    prefix + new - 1``: each attends to itself and every earlier token, or to
    at most ``window`` tokens (itself and ``window - 1`` before it)."""
    if prefix < 0 or new < 0:
        raise ValueError(f"prefix and new must not be negative, got {prefix}, {new}")
    lo, hi = prefix + 1, prefix + new  # context sizes of the first and last query
    if window is None or hi <= window:
        return (lo + hi) * new // 2
    if lo >= window:
        return window * new
    below = (lo + window) * (window - lo + 1) // 2  # queries with context <= window
    return below + window * (hi - window)


class ComputeModel(Protocol):
    """Seconds each cache layer of a batch takes."""

    @property
    def name(self) -> str: ...

    def layer_seconds(self, kinds: Sequence[Component],
                      batch: Sequence[SeqWork]) -> list[float]:
        """One duration per entry of ``kinds`` for the whole ``batch``."""
        ...


# ---- device profiles -----------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class DeviceProfile:
    """One accelerator: dense BF16 peak (FLOP/s), HBM bandwidth (B/s), the
    fraction of each a large prefill reaches (``util``, ``mem_util``) and a
    fixed per-layer cost (kernel launches, ``launch_s``). ``gpus`` devices
    per instance (tensor parallel) multiply both peaks by ``gpus *
    tp_efficiency``."""

    name: str
    peak_flops: float
    hbm_bytes_per_s: float
    util: float
    mem_util: float
    launch_s: float
    source: str
    gpus: int = 1
    tp_efficiency: float = 0.8
    hbm_capacity_bytes: float = 0.0  # per GPU; 0: unknown (no placement check)

    def __post_init__(self) -> None:
        if self.peak_flops <= 0 or self.hbm_bytes_per_s <= 0:
            raise ValueError(f"{self.name}: peak_flops and hbm_bytes_per_s must be positive")
        for name in ("util", "mem_util", "tp_efficiency"):
            if not 0 < getattr(self, name) <= 1:
                raise ValueError(f"{self.name}: {name} must lie in (0, 1], "
                                 f"got {getattr(self, name)}")
        if self.launch_s < 0 or self.gpus < 1 or self.hbm_capacity_bytes < 0:
            raise ValueError(f"{self.name}: launch_s and hbm_capacity_bytes must be >= 0 "
                             "and gpus >= 1")

    def with_gpus(self, gpus: int) -> DeviceProfile:
        """The same device, ``gpus`` of them per instance."""
        return DeviceProfile(self.name, self.peak_flops, self.hbm_bytes_per_s, self.util,
                             self.mem_util, self.launch_s, self.source, gpus,
                             self.tp_efficiency, self.hbm_capacity_bytes)

    @property
    def flops(self) -> float:
        """Sustained FLOP/s of one instance."""
        scale = 1.0 if self.gpus == 1 else self.gpus * self.tp_efficiency
        return self.peak_flops * self.util * scale

    @property
    def bytes_per_s(self) -> float:
        """Sustained HBM bytes/s of one instance."""
        scale = 1.0 if self.gpus == 1 else self.gpus * self.tp_efficiency
        return self.hbm_bytes_per_s * self.mem_util * scale


# Published dense BF16 tensor-core peaks (without sparsity), HBM bandwidth and
# capacity. Utilisation UTIL of peak FLOPs is anchored to one published
# prefill measurement (docs/roofline.md): NVIDIA NIM's LLM benchmarking page
# (NIM 1.8.0, Llama-3.3-70B-Instruct, 2 x H100 80GB, FP8, TP2, 5000 input
# tokens, concurrency 1) reports a TTFT of 406.77 ms: 2 * 70.6e9 * 5000 FLOPs
# plus attention (~3.3e13) in 0.407 s is 0.46 of the two GPUs' dense FP8 peak
# (2 x 1979 TFLOPS), TP overhead and request overhead included. 0.7 of HBM
# for weight streaming (not anchored: the prefill batches here are
# compute-bound).
UTIL = 0.45
DEVICES: dict[str, DeviceProfile] = {
    "h100": DeviceProfile("h100", 989e12, 3.35e12, UTIL, 0.7, 20e-6,
                          "NVIDIA H100 SXM datasheet: 989 TFLOPS BF16 dense, 3.35 TB/s HBM3, "
                          "80 GB", hbm_capacity_bytes=80e9),
    "h200": DeviceProfile("h200", 989e12, 4.8e12, UTIL, 0.7, 20e-6,
                          "NVIDIA H200 SXM datasheet: 989 TFLOPS BF16 dense, 4.8 TB/s HBM3e, "
                          "141 GB", hbm_capacity_bytes=141e9),
    "a100": DeviceProfile("a100", 312e12, 2.039e12, UTIL, 0.7, 20e-6,
                          "NVIDIA A100 SXM 80GB datasheet: 312 TFLOPS BF16, 2.039 TB/s, 80 GB",
                          hbm_capacity_bytes=80e9),
    "l40s": DeviceProfile("l40s", 362e12, 0.864e12, UTIL, 0.7, 20e-6,
                          "NVIDIA L40S datasheet: 362 TFLOPS BF16 dense, 864 GB/s GDDR6, 48 GB",
                          hbm_capacity_bytes=48e9),
}

# Weights may take at most this share of an instance's memory: the rest is
# the KV/state pool and activations (vLLM's default gpu_memory_utilization
# is 0.9 of the device, and the cache needs room inside it).
MAX_WEIGHT_SHARE = 0.8


# ---- architectures ----------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class MoE:
    """A mixture-of-experts MLP: ``experts`` of width ``inter`` (gated: three
    matrices each), ``active`` per token, an optional shared expert."""

    experts: int
    active: int
    inter: int
    shared_inter: int = 0

    def __post_init__(self) -> None:
        if not 0 < self.active <= self.experts or self.inter <= 0 or self.shared_inter < 0:
            raise ValueError(f"bad MoE shape {self}")


@dataclass(frozen=True, slots=True)
class Recurrent:
    """A recurrent mixer (Mamba-2, gated DeltaNet): ``in_proj`` outputs per
    token from ``hidden``, ``out_proj`` inputs back to ``hidden``, the scan's
    FLOPs per token, and its state tensors' bytes per layer (one checkpoint)."""

    kind: str
    in_proj: int
    out_proj: int
    scan_flops: int
    state_bytes: int


@dataclass(frozen=True, slots=True)
class Architecture:
    """A published model's shape, as far as prefill time and cache bytes go.

    ``pattern``: every layer in order, ``F`` full attention, ``S`` sliding,
    ``M`` recurrent (cache layers), ``-`` an MLP-only layer (Nemotron-H);
    an attention or recurrent layer of a model without ``-`` layers carries
    its own MLP (``mlp_with_mixer``). ``mlp_inter`` is the dense MLP width
    (0 with ``moe``; gated = three matrices, else two: ``mlp_gated``). ``weight_bytes`` per parameter (2 for BF16,
    about 0.53 for MXFP4 experts); ``weights_bytes`` the whole checkpoint's
    resident weights (the placement check of :class:`RooflineCompute`)."""

    name: str
    source: str
    pattern: str
    hidden: int
    q_heads: int
    kv_heads: int
    head_dim: int
    window: int
    mlp_inter: int
    moe: MoE | None
    recurrent: Recurrent | None
    q_gate: bool = False
    kv_elem_bytes: int = 2
    weight_bytes: float = 2.0
    expert_weight_bytes: float = 2.0
    mlp_with_mixer: bool = True
    mlp_gated: bool = True
    default_gpus: int = 1
    weights_bytes: float = 0.0  # the published checkpoint's resident weights; 0: unknown

    @property
    def layers(self) -> str:
        """The cache layers' kinds (a :class:`ModelSpec` ``layers`` string)."""
        return self.pattern.replace("-", "")

    @property
    def kv_bytes_per_token_layer(self) -> int:
        """K and V of one attention layer for one token."""
        return 2 * self.kv_heads * self.head_dim * self.kv_elem_bytes

    def mlps_per_layer(self) -> list[int]:
        """MLP blocks each cache layer carries (the MLP-only layers after it)."""
        if self.mlp_with_mixer:
            return [1] * len(self.layers)
        out: list[int] = []
        for ch in self.pattern:
            if ch == "-":
                if not out:
                    raise ValueError(f"{self.name}: pattern starts with an MLP-only layer")
                out[-1] += 1
            else:
                out.append(0)
        return out

    # per new token, per layer kind (FLOPs = 2 per multiply-add)
    def attn_proj_flops(self) -> int:
        q = self.q_heads * self.head_dim * (2 if self.q_gate else 1)
        kv = 2 * self.kv_heads * self.head_dim
        return 2 * self.hidden * (q + kv) + 2 * self.q_heads * self.head_dim * self.hidden

    def recurrent_flops(self) -> int:
        r = self.recurrent
        if r is None:
            raise ValueError(f"{self.name} has no recurrent layers")
        return 2 * self.hidden * r.in_proj + 2 * r.out_proj * self.hidden + r.scan_flops

    def mlp_flops(self) -> int:
        if self.moe is None:
            return (6 if self.mlp_gated else 4) * self.hidden * self.mlp_inter
        m = self.moe
        return (6 * self.hidden * (m.inter * m.active + m.shared_inter)
                + 2 * self.hidden * m.experts)

    def attn_weight_bytes(self) -> float:
        return self.attn_proj_flops() / 2 * self.weight_bytes

    def recurrent_weight_bytes(self) -> float:
        r = self.recurrent
        assert r is not None
        return (self.hidden * r.in_proj + r.out_proj * self.hidden) * self.weight_bytes

    def mlp_weight_bytes(self, tokens: int) -> float:
        """Weights one MLP block reads for ``tokens`` tokens: all of a dense
        MLP; of a MoE the expected number of distinct experts hit,
        ``E * (1 - (1 - k/E) ** tokens)``, plus the shared expert."""
        if self.moe is None:
            mats = 3 if self.mlp_gated else 2
            return mats * self.hidden * self.mlp_inter * self.weight_bytes
        m = self.moe
        touched = m.experts * (1.0 - (1.0 - m.active / m.experts) ** tokens)
        return (3 * self.hidden * (m.inter * touched) * self.expert_weight_bytes
                + 3 * self.hidden * m.shared_inter * self.weight_bytes)


# ---- roofline ---------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class RooflineCompute:
    """:class:`Architecture` on a :class:`DeviceProfile` (see the module
    docstring). ``ValueError`` when the architecture's weights do not fit
    the instance (more than ``MAX_WEIGHT_SHARE`` of its GPUs' memory)."""

    arch: Architecture
    device: DeviceProfile

    def __post_init__(self) -> None:
        a, d = self.arch, self.device
        room = d.hbm_capacity_bytes * d.gpus * MAX_WEIGHT_SHARE
        if a.weights_bytes and d.hbm_capacity_bytes and a.weights_bytes > room:
            need = math.ceil(a.weights_bytes / (d.hbm_capacity_bytes * MAX_WEIGHT_SHARE))
            raise ValueError(
                f"{a.name}'s weights ({a.weights_bytes / 1e9:.0f} GB) do not fit {d.gpus} x "
                f"{d.name} ({d.hbm_capacity_bytes / 1e9:.0f} GB each, at most "
                f"{MAX_WEIGHT_SHARE:.0%} for weights): use --gpus {need} or more")

    @property
    def name(self) -> str:
        gpus = f"x{self.device.gpus}" if self.device.gpus > 1 else ""
        return f"{self.arch.name}@{self.device.name}{gpus}"

    def layer_flops_bytes(self, kind: Component, mlps: int,
                          batch: Sequence[SeqWork]) -> tuple[float, float]:
        """FLOPs and bytes of one layer of ``kind`` carrying ``mlps`` MLP blocks."""
        a = self.arch
        tokens = sum(s.new for s in batch)
        flops = float(mlps * a.mlp_flops() * tokens)
        nbytes = mlps * a.mlp_weight_bytes(tokens)
        if kind is Component.MAMBA:
            r = a.recurrent
            if r is None:
                raise ValueError(f"{a.name} has no recurrent layers")
            flops += a.recurrent_flops() * tokens
            nbytes += a.recurrent_weight_bytes() + r.state_bytes * len(batch)
            return flops, nbytes
        window = a.window if kind is Component.SWA else None
        pairs = sum(attention_pairs(s.prefix, s.new, window) for s in batch)
        flops += a.attn_proj_flops() * tokens + 4 * a.q_heads * a.head_dim * pairs
        read = sum(min(s.prefix, window) if window else s.prefix for s in batch)
        nbytes += a.attn_weight_bytes() + a.kv_bytes_per_token_layer * (read + tokens)
        return flops, nbytes

    def layer_seconds(self, kinds: Sequence[Component],
                      batch: Sequence[SeqWork]) -> list[float]:
        if "".join(k.letter for k in kinds) != self.arch.layers:
            raise ValueError(f"layer kinds {''.join(k.letter for k in kinds)!r} are not "
                             f"{self.arch.name}'s {self.arch.layers!r}")
        dev = self.device
        out = []
        for kind, mlps in zip(kinds, self.arch.mlps_per_layer(), strict=True):
            flops, nbytes = self.layer_flops_bytes(kind, mlps, batch)
            out.append(max(flops / dev.flops, nbytes / dev.bytes_per_s) + dev.launch_s)
        return out


# ---- fitted (cpu-measured) -------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class KindFit:
    """``seconds = base + per_token * tokens + per_pair * pairs`` for one layer kind."""

    base: float
    per_token: float
    per_pair: float = 0.0

    def __post_init__(self) -> None:
        if min(self.base, self.per_token, self.per_pair) < 0 or not all(
                math.isfinite(x) for x in (self.base, self.per_token, self.per_pair)):
            raise ValueError(f"fit coefficients must be finite and >= 0, got {self}")


@dataclass(frozen=True, slots=True)
class FittedCompute:
    """Per-kind linear fits of measured layer times (``cpu-measured``);
    ``window`` is the SWA window the pairs are counted over."""

    name: str
    fits: Mapping[Component, KindFit]
    window: int

    def layer_seconds(self, kinds: Sequence[Component],
                      batch: Sequence[SeqWork]) -> list[float]:
        tokens = sum(s.new for s in batch)
        pairs = {Component.FULL: sum(attention_pairs(s.prefix, s.new) for s in batch),
                 Component.SWA: sum(attention_pairs(s.prefix, s.new, self.window)
                                    for s in batch),
                 Component.MAMBA: 0}
        out = []
        for k in kinds:
            f = self.fits.get(k)
            if f is None:
                raise ValueError(f"{self.name} has no fit for {k.value} layers")
            out.append(f.base + f.per_token * tokens + f.per_pair * pairs[k])
        return out

    @staticmethod
    def fit(samples: Sequence[tuple[Component, int, int, float]]) -> dict[Component, KindFit]:
        """Least squares per kind over ``(kind, tokens, pairs, seconds)``
        samples; coefficients clipped at 0 (refitted without a column that
        came out negative). ``ValueError`` for a kind with fewer than 3."""
        by: dict[Component, list[tuple[int, int, float]]] = {}
        for k, n, p, s in samples:
            by.setdefault(k, []).append((n, p, s))
        out: dict[Component, KindFit] = {}
        for k, rows in by.items():
            if len(rows) < 3:
                raise ValueError(f"need at least 3 samples of {k.value} layers, got {len(rows)}")
            arr = np.asarray(rows, dtype=np.float64)
            cols = [0, 1, 2] if k is not Component.MAMBA else [0, 1]
            coef = _nnls(arr, cols)
            out[k] = KindFit(coef[0], coef[1], coef[2] if len(coef) > 2 else 0.0)
        return out


def _nnls(arr: np.ndarray, cols: list[int]) -> list[float]:
    """Least squares of ``arr[:, 2]`` on (1, tokens, pairs)[cols], dropping
    columns with a negative coefficient until none is left negative."""
    design = np.stack([np.ones(len(arr)), arr[:, 0], arr[:, 1]], axis=1)
    active = list(cols)
    while True:
        sol, *_ = np.linalg.lstsq(design[:, active], arr[:, 2], rcond=None)
        if (sol >= 0).all() or len(active) == 1:
            full = dict(zip(active, np.maximum(sol, 0.0).tolist(), strict=True))
            return [float(full.get(c, 0.0)) for c in range(3)][: max(cols) + 1]
        active.pop(int(np.argmin(sol)))
