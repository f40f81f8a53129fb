"""Where SGLang's device pools keep each layer's bytes, and LayerLift's object layout for them.

Read from SGLang 0.5.23's pool classes (``MHATokenToKVPool``, ``SWAKVPool``,
``HybridLinearKVPool``, ``HybridReqToTokenPool`` with its ``MambaPool``); only
their public tensors and layer maps are used (``k_buffer``/``v_buffer``,
``layers_mapping``, ``full_attention_layer_id_mapping``, ``mamba_map``,
``mamba_cache.temporal``/``conv``), never their transfer helpers.

One :class:`PoolLayout` per SGLang pool (``kv``, ``swa``, ``mamba``). A *unit*
is what one store object holds: a page of ``page_size`` token rows (KV, SWA)
or one state slot (Mamba). The object is LayerLift's format
(:data:`layerlift.linker.integrity.OBJECT_FORMAT`): layer-major, every layer's
parts back to back (K rows then V rows; temporal then conv states), then a
footer of one CRC-32C per layer. Layers are numbered as SGLang's pools wait on
them: the model's layer id minus the stage's ``start_layer``.

Plain and synchronous; no store, no threads.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from layerlift.linker.integrity import CHECK_BYTES
from layerlift.linker.staged import ObjectLayout

__all__ = ["LayerParts", "OffloadItem", "Part", "PoolLayout", "fingerprint", "mamba_layout", "mha_layers",
           "pool_layouts", "refuse_unmoved_state"]


@dataclass(frozen=True, slots=True)
class Part:
    """One device tensor a layer's unit spans: ``rows`` consecutive rows of ``tensor``
    (dim 0 indexes token slots or state slots; rows are contiguous). Its byte
    sizes are read off the tensor once, here: the per-row loops of a load's
    scatter and an offload's snapshot use them for every unit of every layer."""

    tensor: torch.Tensor
    rows: int
    row_bytes: int = field(init=False, repr=False, compare=False)
    nbytes: int = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        row_bytes = int(self.tensor.stride(0)) * self.tensor.element_size()
        object.__setattr__(self, "row_bytes", row_bytes)
        object.__setattr__(self, "nbytes", self.rows * row_bytes)

    def ptr(self, row: int) -> int:
        """Address of row ``row`` (the first row of a unit)."""
        return int(self.tensor.data_ptr()) + row * self.row_bytes


@dataclass(frozen=True, slots=True)
class LayerParts:
    """The parts of one layer in one pool, in object order."""

    layer: int
    parts: tuple[Part, ...]
    nbytes: int = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "nbytes", sum(p.nbytes for p in self.parts))

    def spans(self) -> list[tuple[int, int, int]]:
        """``(base address, row bytes, unit bytes)`` of each part, read once
        for a loop over many units (a unit at row ``r`` of a part starts at
        ``base + r * row_bytes``)."""
        return [(int(p.tensor.data_ptr()), p.row_bytes, p.nbytes) for p in self.parts]


@dataclass(frozen=True, slots=True)
class PoolLayout:
    """One SGLang pool as LayerLift objects. ``name`` is the pool's name in
    SGLang's transfers; ``component`` names it in store keys."""

    name: str
    component: str
    unit_tokens: int
    rows: int  # rows per unit (= unit_tokens for KV/SWA, 1 for Mamba)
    num_rows: int
    layers: tuple[LayerParts, ...]

    @property
    def slices(self) -> list[tuple[int, int]]:
        """``(offset, size)`` of each layer's slice in an object, in footer order."""
        out, at = [], 0
        for lp in self.layers:
            out.append((at, lp.nbytes))
            at += lp.nbytes
        return out

    @property
    def page_bytes(self) -> int:
        return sum(lp.nbytes for lp in self.layers)

    @property
    def object_bytes(self) -> int:
        return self.page_bytes + CHECK_BYTES * len(self.layers)

    @property
    def objects(self) -> ObjectLayout:
        """The staged transfer's view of these objects (``linker/staged.py``)."""
        return ObjectLayout(tuple(self.slices), self.page_bytes)

    def position(self, layer: int) -> int | None:
        """Index of ``layer`` in this pool's footer (None: not a layer of this pool)."""
        for j, lp in enumerate(self.layers):
            if lp.layer == layer:
                return j
        return None

    def unit_rows(self, indices: torch.Tensor, units: int) -> list[int]:
        """The first row of each of ``units`` units named by SGLang's ``indices``
        (token slots, a whole page per unit; or one state slot per unit).

        Raises ValueError for a count that does not match, a page that is not
        aligned and contiguous, or a row outside the pool."""
        flat = indices.detach().to("cpu", torch.int64).flatten()
        if flat.numel() != units * self.unit_tokens:
            raise ValueError(f"the {self.name} transfer has {units} keys but {flat.numel()} "
                             f"slots; expected {self.unit_tokens} slot(s) per key")
        if units == 0:
            return []
        pages = flat.reshape(units, self.unit_tokens)
        starts = pages[:, 0]
        if self.unit_tokens > 1 and (
                bool(torch.any(starts % self.unit_tokens))
                or not torch.equal(pages, starts[:, None] + torch.arange(self.unit_tokens))):
            raise ValueError(f"the {self.name} transfer's slots are not whole aligned pages")
        if int(starts.min()) < 0 or int(starts.max()) + self.rows > self.num_rows:
            raise ValueError(f"the {self.name} transfer names slots outside the pool "
                             f"(0..{self.num_rows - 1})")
        return [int(s) for s in starts.tolist()]


@dataclass(frozen=True, slots=True)
class OffloadItem:
    """One pool's part of one offload: store keys and the first row of each unit."""

    layout: PoolLayout
    keys: tuple[str, ...]
    rows: tuple[int, ...]


def _rows_view(t: torch.Tensor) -> torch.Tensor:
    if not t.is_contiguous():
        raise ValueError("LayerLiftLinker needs contiguous pool buffers; one has strides "
                         f"{tuple(t.stride())}")
    if t.device.type not in ("cpu", "cuda"):
        raise ValueError(
            "LayerLiftLinker supports pools on the CPU (host copies) or on a CUDA device "
            f"(copies on a load stream, ``device``); this pool is on {t.device}")
    return t


def mha_layers(pool: Any, layer_of: dict[int, int]) -> list[LayerParts]:
    """The layers of an MHA pool (``k_buffer``/``v_buffer`` lists, ``page_size``, as
    SGLang's ``MHATokenToKVPool``); ``layer_of``: stage layer -> index into its buffers."""
    if getattr(pool, "k_scale_buffer", None) is not None or \
            getattr(pool, "native_k_scale_buffer", None) is not None:
        raise ValueError("LayerLiftLinker does not support scaled (quantized) KV caches")
    page = int(pool.page_size)
    out = []
    for layer, i in sorted(layer_of.items()):
        k, v = _rows_view(pool.k_buffer[i]), _rows_view(pool.v_buffer[i])
        out.append(LayerParts(layer, (Part(k, page), Part(v, page))))
    return out


def _kv_layouts(kvcache: Any, page_size: int) -> list[PoolLayout]:
    from sglang.srt.mem_cache.memory_pool import HybridLinearKVPool, MHATokenToKVPool
    from sglang.srt.mem_cache.swa_memory_pool import SWAKVPool

    start = int(getattr(kvcache, "start_layer", 0) or 0)
    if isinstance(kvcache, SWAKVPool):
        full = {g - start: i for g, (i, swa) in kvcache.layers_mapping.items() if not swa}
        swa = {g - start: i for g, (i, is_swa) in kvcache.layers_mapping.items() if is_swa}
        pools = [("kv", "full", kvcache.full_kv_pool, full), ("swa", "swa", kvcache.swa_kv_pool, swa)]
    elif isinstance(kvcache, HybridLinearKVPool):
        mapping = {g - start: i for g, i in kvcache.full_attention_layer_id_mapping.items()}
        pools = [("kv", "full", kvcache.full_kv_pool, mapping)]
    elif isinstance(kvcache, MHATokenToKVPool):
        pools = [("kv", "full", kvcache, {i: i for i in range(len(kvcache.k_buffer))})]
    else:
        raise ValueError(f"LayerLiftLinker supports MHA, SWA and hybrid-linear KV pools; got "
                         f"{type(kvcache).__name__}")
    out = []
    for name, component, pool, layer_of in pools:
        if not isinstance(pool, MHATokenToKVPool):
            raise ValueError(f"LayerLiftLinker supports MHA sub-pools; the {name} pool is "
                             f"{type(pool).__name__}")
        if int(pool.page_size) != page_size:
            raise ValueError(f"the {name} pool's page size {pool.page_size} is not the "
                             f"tree's {page_size}")
        layers = mha_layers(pool, layer_of)
        if layers:
            rows = min(int(p.tensor.shape[0]) for lp in layers for p in lp.parts)
            out.append(PoolLayout(name, component, page_size, page_size, rows, tuple(layers)))
    return out


def mamba_layout(req_to_token_pool: Any) -> PoolLayout:
    """The Mamba pool of ``req_to_token_pool`` (SGLang's ``HybridReqToTokenPool``: its
    ``mamba_pool.mamba_cache.temporal``/``conv`` and ``mamba_map``) as one unit per state
    slot."""
    pool = req_to_token_pool.mamba_pool
    start = int(getattr(req_to_token_pool, "start_layer", 0) or 0)
    cache = pool.mamba_cache
    states = [s for s in (cache.temporal, *cache.conv) if s.numel() > 0]
    layers = []
    for g, i in sorted(req_to_token_pool.mamba_map.items()):
        layers.append(LayerParts(g - start, tuple(Part(_rows_view(s[i]), 1) for s in states)))
    rows = min(int(s.shape[1]) for s in states)
    return PoolLayout("mamba", "mamba", 1, 1, rows, tuple(layers))


def pool_layouts(kvcache: Any, req_to_token_pool: Any, page_size: int,
                 components: Sequence[str]) -> dict[str, PoolLayout]:
    """The layouts of the pools SGLang's tree uses (``components``: names of
    its ComponentTypes, e.g. "FULL", "SWA", "MAMBA"). Raises ValueError for a
    pool this adapter does not support, naming it."""
    layouts = {p.name: p for p in _kv_layouts(kvcache, page_size)}
    wanted = {"kv"} | ({"swa"} if "SWA" in components else set())
    if "MAMBA" in components:
        layouts["mamba"] = mamba_layout(req_to_token_pool)
        wanted.add("mamba")
    unknown = set(components) - {"FULL", "SWA", "MAMBA"}
    if unknown:
        raise ValueError(f"LayerLiftLinker supports the FULL, SWA and MAMBA components; got "
                         f"{sorted(unknown)}")
    missing = wanted - set(layouts)
    if missing:
        raise ValueError(f"the tree uses {sorted(missing)} but the pools have none")
    return {name: layouts[name] for name in sorted(wanted)}


def refuse_unmoved_state(params: Any, components: Sequence[str]) -> None:
    """ValueError, with a sentence, for pool features whose state this linker
    does not move (restoring the rest would leave that state wrong under valid
    checksums). SGLang refuses the same features for its own direct linker at
    start-up (``linker_pool_assembler``)."""
    rtp = params.req_to_token_pool
    if "MAMBA" in components:
        if getattr(rtp, "mamba_ckpt_pool", None) is not None:
            raise ValueError(
                "LayerLiftLinker does not support int8 Mamba checkpoints "
                "(--enable-int8-mamba-checkpoint): the tree's Mamba values are then ids in the "
                "checkpoint pool, whose states LayerLift does not move; launch without it")
        for name, what in (("short_conv_pool", "short-conv"), ("ngram_pool", "n-gram")):
            side = getattr(rtp, name, None)
            if side is not None and getattr(side, "enabled", False):
                raise ValueError(
                    f"LayerLiftLinker does not support Mamba side states ({what} state, "
                    f"{name}): LayerLift moves the Mamba pool's temporal and conv states only")
    for name in ("mtp_draft_device_pools", "sidecar_draft_device_pools", "mtp_draft_mamba_pools"):
        if tuple(getattr(params, name, None) or ()):
            raise ValueError(
                f"LayerLiftLinker does not support draft KV pools ({name}: speculative "
                "decoding's draft model): it would restore the target's KV but not the "
                "draft's; launch without speculative decoding or without the linker")


def fingerprint(model: str, layouts: dict[str, PoolLayout], stage: str) -> str:
    """A key fingerprint naming the model and every byte-layout fact of its
    objects (pools, layers, row sizes, dtypes, page size) and the parallel
    layout (``stage``: TP size, attention TP/DP/CP layout, pipeline stage;
    with the rank in the key it fixes the rank's head range): a different
    layout never matches a key."""
    facts = [stage]
    for name, p in sorted(layouts.items()):
        facts.append(f"{name}:{p.component}:{p.unit_tokens}")
        for lp in p.layers:
            facts.append(f"{lp.layer}=" + ",".join(
                f"{part.rows}x{part.row_bytes}:{part.tensor.dtype}" for part in lp.parts))
    digest = hashlib.sha256(f"{model}|{'|'.join(facts)}".encode()).hexdigest()[:16]
    slug = re.sub(r"[^A-Za-z0-9._:+=@-]+", "-", model.strip("/").split("/")[-1])[:40] or "model"
    return f"{slug}-{digest}"
