"""Model layout: which kind every layer is, and how many bytes each kind's state takes.

A hybrid model mixes three layer kinds, each with its own device pool
(a *component*):

* ``FULL``  - full causal attention; KV indexed by token page.
* ``SWA``   - sliding-window attention; KV indexed by token page, only the last
  ``swa_window`` tokens are ever read.
* ``MAMBA`` - a recurrent mixer (Mamba-2, gated DeltaNet, short conv...); its
  state is any list of tensors (:class:`MambaSpec`) and is indexed by *slot*:
  one slot holds the state of every recurrent layer at one token boundary.

Byte layout (shared by the device pools and the store's page objects, see
docs/design.md §4): a FULL page is ``[layer0 K|V][layer1 K|V]...`` over the
FULL layers only, so a whole page is one contiguous copy and the slice of one
layer is one contiguous range. SWA pages likewise; a MAMBA slot is
``[layer0 s0|s1..][layer1 s0|s1..]...``.

Keys and values need not have one shape (:class:`KVShape`): multi-head latent
attention (DeepSeek-V3, Kimi) has keys of ``nope + rope`` width and narrower
values, and a cache that holds MLA's compressed latent stores one "head" of
``kv_lora_rank`` as keys and one of ``qk_rope_head_dim`` as values. Each
attention layer may have its own shape; its slice is then as wide as its own
K and V, and the per-layer offsets inside a page object add up the slices
before it.

:class:`ModelSpec` is the cache layout only; the reference model's
hyperparameters (vocabulary, widths) ride along in :class:`ModelDims` and
never reach the pools.
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass, field, fields
from enum import Enum
from functools import cached_property

import torch

__all__ = [
    "PLACEHOLDER_PAGE_BYTES",
    "AttentionSpec",
    "Component",
    "KVShape",
    "LayerSlice",
    "MambaSpec",
    "ModelDims",
    "ModelSpec",
    "SlidingWindowSpec",
    "StateTensorSpec",
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
class KVShape:
    """Per token, the keys ``[k_heads, k_dim]`` and values ``[v_heads, v_dim]``
    one attention layer keeps in its cache. Ordinary attention has one shape
    for both (:meth:`uniform`); MLA does not. Raises ``ValueError`` for a
    non-positive size."""

    k_heads: int
    k_dim: int
    v_heads: int
    v_dim: int

    def __post_init__(self) -> None:
        for name in ("k_heads", "k_dim", "v_heads", "v_dim"):
            if int(getattr(self, name)) <= 0:
                raise ValueError(f"KV shape: {name} must be positive, got {getattr(self, name)}")

    @classmethod
    def uniform(cls, heads: int, dim: int) -> KVShape:
        """Keys and values both ``[heads, dim]``."""
        return cls(heads, dim, heads, dim)

    @property
    def k_elems(self) -> int:
        """Elements of one token's keys."""
        return self.k_heads * self.k_dim

    @property
    def v_elems(self) -> int:
        """Elements of one token's values."""
        return self.v_heads * self.v_dim


@dataclass(frozen=True, slots=True)
class SlidingWindowSpec(AttentionSpec):
    """Like :class:`AttentionSpec`; a token attends to itself and the
    ``window - 1`` tokens before it."""

    window: int = 0

    @property
    def window_pages(self) -> int:
        return self.window // self.page_size


@dataclass(frozen=True, slots=True)
class StateTensorSpec:
    """One recurrent state tensor of one layer (e.g. a conv or an SSM state),
    without the batch dimension."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype

    def __post_init__(self) -> None:
        if not self.shape or any(int(n) <= 0 for n in self.shape):
            raise ValueError(f"state tensor {self.name!r} needs a non-empty positive shape, "
                             f"got {self.shape}")

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.numel * _elem(self.dtype)


@dataclass(frozen=True, slots=True)
class MambaSpec:
    """The recurrent state of one MAMBA-kind layer: any list of tensors, each
    with its own shape and dtype, laid out back to back in one slot.

    Mamba-2 has ``(conv, ssm)``, gated DeltaNet ``(conv, recurrent)``, a short
    convolution ``(conv,)``. Each tensor starts at a multiple of its element
    size and the layer's slice is padded to a multiple of the largest one, so
    every tensor of every layer of every slot is a plain typed view of the
    pool's bytes.
    """

    tensors: tuple[StateTensorSpec, ...]

    def __post_init__(self) -> None:
        if not self.tensors:
            raise ValueError("a recurrent layer needs at least one state tensor")

    @classmethod
    def mamba2(cls, num_heads: int, head_dim: int, d_state: int, d_conv: int,
               dtype: torch.dtype = torch.float32) -> MambaSpec:
        """Mamba-2 (one group): conv ``[num_heads*head_dim + 2*d_state, d_conv-1]``
        then SSM ``[num_heads, head_dim, d_state]``."""
        conv_dim = num_heads * head_dim + 2 * d_state
        return cls((StateTensorSpec("conv", (conv_dim, d_conv - 1), dtype),
                    StateTensorSpec("ssm", (num_heads, head_dim, d_state), dtype)))

    @property
    def offsets(self) -> tuple[int, ...]:
        """Byte offset of every tensor inside the layer's slice."""
        out, at = [], 0
        for t in self.tensors:
            at = _round_up(at, _elem(t.dtype))
            out.append(at)
            at += t.nbytes
        return tuple(out)

    @property
    def layer_slot_bytes(self) -> int:
        end = self.offsets[-1] + self.tensors[-1].nbytes
        return _round_up(end, max(_elem(t.dtype) for t in self.tensors))


def _round_up(n: int, unit: int) -> int:
    return -(-n // unit) * unit


@dataclass(frozen=True, slots=True)
class ModelDims:
    """Hyperparameters of the reference model (``HybridModel``), not of the
    cache: the pools never read them. ``mamba_*`` shape the reference model's
    Mamba-2 mixer (and so its state, see :meth:`MambaSpec.mamba2`)."""

    vocab_size: int = 512
    hidden_size: int = 64
    num_heads: int = 4
    intermediate_size: int = 128
    mamba_heads: int = 4
    mamba_head_dim: int = 16
    mamba_d_state: int = 16
    mamba_d_conv: int = 4
    rms_eps: float = 1e-6

    def __post_init__(self) -> None:
        for name in ("vocab_size", "hidden_size", "num_heads", "intermediate_size",
                     "mamba_heads", "mamba_head_dim", "mamba_d_state"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if self.mamba_d_conv < 2:
            raise ValueError(f"mamba_d_conv must be at least 2, got {self.mamba_d_conv}")
        if self.rms_eps <= 0:
            raise ValueError(f"rms_eps must be positive, got {self.rms_eps}")

    def mamba_state(self) -> MambaSpec:
        return MambaSpec.mamba2(self.mamba_heads, self.mamba_head_dim, self.mamba_d_state,
                                self.mamba_d_conv)


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

_DIM_NAMES = frozenset(f.name for f in fields(ModelDims))

PLACEHOLDER_PAGE_BYTES = 64
"""Page (or slot) size of a component the model has no layer of (a model
without sliding layers, or without recurrent ones): the engine and the store
treat every model alike, so such a component keeps a tiny page that no layer
reads or writes."""


@dataclass(frozen=True)
class ModelSpec:
    """The cache layout of a hybrid model: what the pools are built from.

    ``layers`` names every cache layer's kind in order, e.g. ``"FSMSFSMM"``
    (``F`` full attention, ``S`` sliding window, ``M`` recurrent). KV of FULL
    and SWA layers is ``[page_size, num_kv_heads, head_dim]`` K then V in
    ``dtype``; a MAMBA layer's state is ``state`` (any list of tensors, each
    with its own shape and dtype). ``swa_window`` and ``track_interval`` are in
    tokens and must be multiples of ``page_size``. Raises ``ValueError`` on
    any inconsistency.

    ``kv_shapes``, when given, names the :class:`KVShape` of every attention
    layer (FULL and SWA, in layer order) and overrides ``num_kv_heads`` and
    ``head_dim`` for them: keys and values of different widths (MLA), or
    layers of different widths. A layer's K then V are ``[page_size,
    k_heads, k_dim]`` and ``[page_size, v_heads, v_dim]``; read a layer's
    shape with :meth:`kv_shape` and its place with :meth:`layer_slice`.
    Shapes that are all ``num_kv_heads x head_dim`` are stored as ``None``.

    ``dims`` are the reference model's hyperparameters (vocabulary, widths):
    they are not part of the layout and the pools never read them. When
    ``state`` is omitted it is the reference model's Mamba-2 state of
    ``dims``.
    """

    layers: str
    num_kv_heads: int = 2
    head_dim: int = 16
    page_size: int = 16
    swa_window: int = 64
    track_interval: int = 64
    dtype: str = "float32"
    state: MambaSpec | None = None
    kv_shapes: tuple[KVShape, ...] | None = None
    dims: ModelDims = field(default_factory=ModelDims, compare=False)
    name: str = field(default="custom", compare=False)

    def __post_init__(self) -> None:
        if not self.layers:
            raise ValueError("layers must name at least one layer, e.g. 'FSMSFSMM'")
        for ch in self.layers:
            Component.from_letter(ch)
        for name in ("num_kv_heads", "head_dim", "page_size", "swa_window", "track_interval"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        for name in ("swa_window", "track_interval"):
            if getattr(self, name) % self.page_size:
                raise ValueError(
                    f"{name} ({getattr(self, name)} tokens) must be a multiple of "
                    f"page_size ({self.page_size} tokens)"
                )
        _dtype(self.dtype)
        if self.state is None:
            object.__setattr__(self, "state", self.dims.mamba_state())
        if self.kv_shapes is not None:
            shapes = tuple(self.kv_shapes)
            n_attn = sum(ch != "M" for ch in self.layers)
            if len(shapes) != n_attn or not all(isinstance(s, KVShape) for s in shapes):
                raise ValueError(
                    f"kv_shapes must give one KVShape per attention layer ({n_attn} in "
                    f"{self.layers!r}), got {len(shapes)} entries"
                )
            default = KVShape.uniform(self.num_kv_heads, self.head_dim)
            object.__setattr__(self, "kv_shapes",
                               None if all(s == default for s in shapes) else shapes)

    @classmethod
    def preset(cls, name: str, **overrides: object) -> ModelSpec:
        """A named layout: ``tiny`` (tests), ``tiny128`` (seed-scale pages),
        ``small`` and ``medium`` (benchmarks). ``overrides`` may name layout
        fields and :class:`ModelDims` fields alike."""
        if name not in _PRESETS:
            raise ValueError(f"unknown preset {name!r}; choose one of {sorted(_PRESETS)}")
        kwargs = {**_PRESETS[name], **overrides}
        dims = {k: kwargs.pop(k) for k in list(kwargs) if k in _DIM_NAMES}
        return cls(name=name, dims=ModelDims(**dims), **kwargs)  # type: ignore[arg-type]

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

    @property
    def vocab_size(self) -> int:
        """Deprecated: the vocabulary is the model's (``model.vocab_size``),
        not the cache layout's; kept while callers move over."""
        return self.dims.vocab_size

    # ---- per-kind specs ---------------------------------------------------
    @property
    def kv_dtype(self) -> torch.dtype:
        return _dtype(self.dtype)

    @cached_property
    def full(self) -> AttentionSpec:
        """The default (``num_kv_heads x head_dim``) FULL layer; per-layer
        shapes (``kv_shapes``) are read with :meth:`kv_shape`."""
        return AttentionSpec(self.num_kv_heads, self.head_dim, self.page_size, self.kv_dtype)

    @cached_property
    def swa(self) -> SlidingWindowSpec:
        return SlidingWindowSpec(
            self.num_kv_heads, self.head_dim, self.page_size, self.kv_dtype, self.swa_window
        )

    @property
    def mamba(self) -> MambaSpec:
        """The state layout of every MAMBA layer."""
        assert self.state is not None  # set in __post_init__
        return self.state

    @property
    def window_pages(self) -> int:
        return self.swa_window // self.page_size

    @property
    def track_pages(self) -> int:
        return self.track_interval // self.page_size

    def kv_shape(self, layer: int) -> KVShape:
        """The K and V shape (per token) of FULL or SWA layer ``layer``.
        Raises ``ValueError`` for a MAMBA layer."""
        if self.kinds[layer] is Component.MAMBA:
            raise ValueError(f"layer {layer} is a recurrent layer: it keeps state, not K and V")
        if self.kv_shapes is None:
            return KVShape.uniform(self.num_kv_heads, self.head_dim)
        return self.kv_shapes[layer - self.kinds[:layer].count(Component.MAMBA)]

    # ---- bytes ------------------------------------------------------------
    @cached_property
    def _slice_bytes(self) -> tuple[int, ...]:
        """Bytes of every layer's slice of one page or slot, by global layer."""
        elem = _elem(self.kv_dtype)
        out = []
        for layer, kind in enumerate(self.kinds):
            if kind is Component.MAMBA:
                out.append(self.mamba.layer_slot_bytes)
            else:
                s = self.kv_shape(layer)
                out.append(self.page_size * (s.k_elems + s.v_elems) * elem)
        return tuple(out)

    def layer_bytes(self, component: Component) -> int:
        """Bytes of one layer's slice of one page (FULL/SWA) or slot (MAMBA),
        the same for every layer of ``component``. Raises ``ValueError`` when
        its layers differ in width: use :meth:`layer_slice` per layer then."""
        if component is Component.MAMBA:
            return self.mamba.layer_slot_bytes
        sizes = {self._slice_bytes[g] for g in self.layers_of(component)}
        if not sizes:
            default = self.full if component is Component.FULL else self.swa
            return default.layer_page_bytes
        if len(sizes) > 1:
            raise ValueError(f"the {component.value} layers differ in width ({sorted(sizes)} "
                             "bytes per page): ask layer_slice(layer) for one layer's size")
        return sizes.pop()

    def page_bytes(self, component: Component) -> int:
        """Bytes of one whole page (FULL/SWA) or slot (MAMBA): one store object.
        A component without layers keeps a :data:`PLACEHOLDER_PAGE_BYTES` page."""
        n = sum(self._slice_bytes[g] for g in self.layers_of(component))
        return n if n else PLACEHOLDER_PAGE_BYTES

    def layer_slice(self, layer: int) -> LayerSlice:
        """Where layer ``layer`` lives inside its component's page object."""
        component = self.kinds[layer]
        j = self.local_index(layer)
        before = self.layers_of(component)[:j]
        offset = sum(self._slice_bytes[g] for g in before)
        return LayerSlice((component, j, offset, self._slice_bytes[layer]))

    @cached_property
    def fingerprint(self) -> str:
        """A short hash of everything that decides the bytes of a page object.

        Two specs with a different layout, shape, dtype, page size, window,
        track interval, state layout or per-layer K and V widths never share a
        fingerprint, so they never read each other's store objects. The
        weights are not in it: the engine adds the model's identity.
        """
        state = tuple((t.name, t.shape, str(t.dtype)) for t in self.mamba.tensors)
        parts: tuple[object, ...] = (
            self.layers, self.num_kv_heads, self.head_dim, self.dtype, self.page_size,
            self.swa_window, self.track_interval, state,
        )
        if self.kv_shapes is not None:  # uniform shapes keep their old fingerprint
            parts += (tuple((s.k_heads, s.k_dim, s.v_heads, s.v_dim) for s in self.kv_shapes),)
        return hashlib.blake2b(repr(parts).encode(), digest_size=8).hexdigest()
