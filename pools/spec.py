"""Model layout: which kind every layer is, and how many bytes each kind's state takes.

A hybrid model mixes three layer kinds, each with its own device pool
(a *component*):

* ``FULL``  - full causal attention; KV indexed by token page.
* ``SWA``   - sliding-window attention; KV indexed by token page, only the last
  ``swa_window`` tokens are ever read.
* ``MAMBA`` - a recurrent mixer; its state (conv + SSM) is indexed by *slot*:
  one slot holds the state of every Mamba layer at one token boundary.

Byte layout (shared by the device pools and the store's page objects, see
DESIGN.md section 4): a FULL page is ``[layer0 K|V][layer1 K|V]...`` over the
FULL layers only, so a whole page is one contiguous copy and the slice of one
layer is one contiguous range. SWA pages likewise; a MAMBA slot is
``[layer0 conv|ssm][layer1 conv|ssm]...``.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from enum import Enum
from functools import cached_property

import torch

__all__ = [
    "AttentionSpec",
    "Component",
    "LayerSlice",
    "MambaSpec",
    "ModelSpec",
    "SlidingWindowSpec",
]


class Component(str, Enum):  # noqa: UP042 - str mixin keeps .value in f-strings explicit
    """The three cache components; the value is used in store keys."""

    FULL = "full"
    SWA = "swa"
    MAMBA = "mamba"

    @property
    def letter(self) -> str:
        return {"full": "F", "swa": "S", "mamba": "M"}[self.value]

    @classmethod
    def from_letter(cls, letter: str) -> Component:
        for c in cls:
            if c.letter == letter:
                return c
        raise ValueError(
            f"unknown layer kind {letter!r}: use 'F' (full attention), "
            "'S' (sliding window) or 'M' (Mamba)"
        )


_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}


def _dtype(name: str) -> torch.dtype:
    try:
        return _DTYPES[name]
    except KeyError:
        raise ValueError(f"unsupported dtype {name!r}; choose one of {sorted(_DTYPES)}") from None


def _elem(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


@dataclass(frozen=True, slots=True)
class AttentionSpec:
    """KV of one full-attention layer for one page: K then V, each
    ``[page_size, num_kv_heads, head_dim]``."""

    num_kv_heads: int
    head_dim: int
    page_size: int
    dtype: torch.dtype

    @property
    def layer_page_bytes(self) -> int:
        return 2 * self.page_size * self.num_kv_heads * self.head_dim * _elem(self.dtype)


@dataclass(frozen=True, slots=True)
class SlidingWindowSpec(AttentionSpec):
    """Like :class:`AttentionSpec`; a token attends to itself and the
    ``window - 1`` tokens before it."""

    window: int = 0

    @property
    def window_pages(self) -> int:
        return self.window // self.page_size


@dataclass(frozen=True, slots=True)
class MambaSpec:
    """State of one Mamba-2-style layer: conv state ``[conv_dim, d_conv - 1]``
    then SSM state ``[num_heads, head_dim, d_state]``, both in ``dtype``."""

    num_heads: int
    head_dim: int
    d_state: int
    d_conv: int
    dtype: torch.dtype

    @property
    def d_inner(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def conv_dim(self) -> int:
        return self.d_inner + 2 * self.d_state

    @property
    def conv_shape(self) -> tuple[int, int]:
        return (self.conv_dim, self.d_conv - 1)

    @property
    def ssm_shape(self) -> tuple[int, int, int]:
        return (self.num_heads, self.head_dim, self.d_state)

    @property
    def conv_bytes(self) -> int:
        return self.conv_dim * (self.d_conv - 1) * _elem(self.dtype)

    @property
    def ssm_bytes(self) -> int:
        return self.num_heads * self.head_dim * self.d_state * _elem(self.dtype)

    @property
    def layer_slot_bytes(self) -> int:
        return self.conv_bytes + self.ssm_bytes


class LayerSlice(tuple[Component, int, int, int]):
    """``(component, local_index, offset, nbytes)`` of one layer inside its
    component's page object."""

    __slots__ = ()

    @property
    def component(self) -> Component:
        return self[0]

    @property
    def local_index(self) -> int:
        return self[1]

    @property
    def offset(self) -> int:
        return self[2]

    @property
    def nbytes(self) -> int:
        return self[3]


_PRESETS: dict[str, dict[str, object]] = {
    # Unit tests: 8 layers, small pages, every kind present.
    "tiny": dict(layers="FSMSFSMM", page_size=16, swa_window=64, track_interval=64),
    # Seed-scale end-to-end tests (SGLang #41343: page and track interval 128).
    "tiny128": dict(layers="FSMSFSMM", page_size=128, swa_window=256, track_interval=128),
    # Benchmarks: more layers and wider state so per-layer pieces are not tiny.
    "small": dict(
        layers="FSMS" * 4, hidden_size=256, num_heads=8, num_kv_heads=4, head_dim=64,
        intermediate_size=512, mamba_heads=8, mamba_head_dim=32, mamba_d_state=32,
        page_size=64, swa_window=256, track_interval=128,
    ),
    "medium": dict(
        layers="FSMSFSMS" * 4, hidden_size=512, num_heads=8, num_kv_heads=8, head_dim=64,
        intermediate_size=1024, mamba_heads=16, mamba_head_dim=32, mamba_d_state=64,
        page_size=64, swa_window=512, track_interval=256,
    ),
}


@dataclass(frozen=True)
class ModelSpec:
    """The layout of a hybrid model: layer kinds, shapes, dtype and paging.

    ``layers`` names every layer's kind in order, e.g. ``"FSMSFSMM"``. Every
    kind must occur at least once (LayerLift is for hybrid models). KV uses
    ``dtype``; Mamba state is always float32 (recurrent state loses too much
    precision in 16-bit). ``swa_window`` and ``track_interval`` are in tokens
    and must be multiples of ``page_size``. Raises ``ValueError`` on any
    inconsistency.
    """

    layers: str
    vocab_size: int = 512
    hidden_size: int = 64
    num_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int = 16
    intermediate_size: int = 128
    mamba_heads: int = 4
    mamba_head_dim: int = 16
    mamba_d_state: int = 16
    mamba_d_conv: int = 4
    page_size: int = 16
    swa_window: int = 64
    track_interval: int = 64
    dtype: str = "float32"
    rms_eps: float = 1e-6
    name: str = field(default="custom", compare=False)

    def __post_init__(self) -> None:
        if not self.layers:
            raise ValueError("layers must name at least one layer, e.g. 'FSMSFSMM'")
        kinds = {Component.from_letter(ch) for ch in self.layers}
        missing = [c.letter for c in Component if c not in kinds]
        if missing:
            raise ValueError(
                f"layers {self.layers!r} has no {'/'.join(missing)} layer: LayerLift "
                "restores hybrid models and needs at least one F, one S and one M layer"
            )
        for name in ("vocab_size", "hidden_size", "num_heads", "num_kv_heads", "head_dim",
                     "intermediate_size", "mamba_heads", "mamba_head_dim", "mamba_d_state",
                     "page_size", "swa_window", "track_interval"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if self.mamba_d_conv < 2:
            raise ValueError(f"mamba_d_conv must be at least 2, got {self.mamba_d_conv}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads "
                f"({self.num_kv_heads}) for grouped-query attention"
            )
        for name in ("swa_window", "track_interval"):
            if getattr(self, name) % self.page_size:
                raise ValueError(
                    f"{name} ({getattr(self, name)} tokens) must be a multiple of "
                    f"page_size ({self.page_size} tokens)"
                )
        _dtype(self.dtype)
        if self.rms_eps <= 0:
            raise ValueError(f"rms_eps must be positive, got {self.rms_eps}")

    @classmethod
    def preset(cls, name: str, **overrides: object) -> ModelSpec:
        """A named layout: ``tiny`` (tests), ``tiny128`` (seed-scale pages),
        ``small`` and ``medium`` (benchmarks)."""
        if name not in _PRESETS:
            raise ValueError(f"unknown preset {name!r}; choose one of {sorted(_PRESETS)}")
        kwargs = {**_PRESETS[name], **overrides}
        return cls(name=name, **kwargs)  # type: ignore[arg-type]

    @staticmethod
    def preset_names() -> list[str]:
        return sorted(_PRESETS)

    # ---- kinds and layers ------------------------------------------------
    @cached_property
    def kinds(self) -> tuple[Component, ...]:
        return tuple(Component.from_letter(ch) for ch in self.layers)

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    def layers_of(self, component: Component) -> tuple[int, ...]:
        """Global indices of the layers of one kind, in order."""
        return tuple(i for i, k in enumerate(self.kinds) if k is component)

    def local_index(self, layer: int) -> int:
        """Index of ``layer`` among the layers of its own kind."""
        kind = self.kinds[layer]
        return self.kinds[:layer].count(kind)

    # ---- per-kind specs ---------------------------------------------------
    @property
    def kv_dtype(self) -> torch.dtype:
        return _dtype(self.dtype)

    @property
    def state_dtype(self) -> torch.dtype:
        return torch.float32

    @cached_property
    def full(self) -> AttentionSpec:
        return AttentionSpec(self.num_kv_heads, self.head_dim, self.page_size, self.kv_dtype)

    @cached_property
    def swa(self) -> SlidingWindowSpec:
        return SlidingWindowSpec(
            self.num_kv_heads, self.head_dim, self.page_size, self.kv_dtype, self.swa_window
        )

    @cached_property
    def mamba(self) -> MambaSpec:
        return MambaSpec(
            self.mamba_heads, self.mamba_head_dim, self.mamba_d_state, self.mamba_d_conv,
            self.state_dtype,
        )

    @property
    def window_pages(self) -> int:
        return self.swa_window // self.page_size

    @property
    def track_pages(self) -> int:
        return self.track_interval // self.page_size

    # ---- bytes ------------------------------------------------------------
    def layer_bytes(self, component: Component) -> int:
        """Bytes of one layer's slice of one page (FULL/SWA) or slot (MAMBA)."""
        if component is Component.FULL:
            return self.full.layer_page_bytes
        if component is Component.SWA:
            return self.swa.layer_page_bytes
        return self.mamba.layer_slot_bytes

    def page_bytes(self, component: Component) -> int:
        """Bytes of one whole page (FULL/SWA) or slot (MAMBA): one store object."""
        return self.layer_bytes(component) * len(self.layers_of(component))

    def layer_slice(self, layer: int) -> LayerSlice:
        """Where layer ``layer`` lives inside its component's page object."""
        component = self.kinds[layer]
        j = self.local_index(layer)
        size = self.layer_bytes(component)
        return LayerSlice((component, j, j * size, size))

    @cached_property
    def fingerprint(self) -> str:
        """A short hash of everything that decides the bytes of a page object.

        Two specs with a different layout, shape, dtype, page size, window or
        track interval never share a fingerprint, so they never read each
        other's store objects.
        """
        parts = (
            self.layers, self.num_kv_heads, self.head_dim, self.dtype, self.page_size,
            self.swa_window, self.track_interval, self.mamba_heads, self.mamba_head_dim,
            self.mamba_d_state, self.mamba_d_conv, str(self.state_dtype),
            self.hidden_size, self.num_heads, self.vocab_size, self.intermediate_size,
        )
        return hashlib.blake2b(repr(parts).encode(), digest_size=8).hexdigest()
