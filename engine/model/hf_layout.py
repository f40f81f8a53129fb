"""The cache layout of a transformers model, derived from its standard cache layers.

transformers (5.24) builds ``DynamicCache(config=cfg)`` as one layer object
per decoder layer, chosen from a small set of standard classes: full
attention (``DynamicLayer``), sliding window (``DynamicSlidingWindowLayer``),
linear attention / recurrent (``LinearAttentionLayer``: conv and recurrent
states), the combined attention + recurrent layers, and ``DummyLayer`` for
layers without a cache (MLP, MoE, KV-sharing consumers). The layout is read
from those objects after a two-token probe forward (recurrent states are
created lazily, so their shapes and dtypes are only known once a layer ran),
never from a table of architectures: any model built on these classes maps
onto FULL, SWA and MAMBA cache layers.

Each attention layer keeps whatever its cache layer holds, with its own K and
V shapes (:class:`~layerlift.pools.spec.KVShape`): full K/V of equal widths,
MLA's keys and narrower values, or MLA's compressed latent (Kimi Linear keeps
``kv_lora_rank`` as "keys" and ``qk_rope_head_dim`` as "values", one head
each). A decoder layer that holds both a recurrent state and KV becomes two
cache layers (MAMBA then FULL/SWA) that share one decoder layer.

Whatever cannot be restored exactly is refused here, at construction, with an
:class:`UnsupportedModelError` naming the architecture, the layer, the reason
and what support would take.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from layerlift.pools.spec import KVShape, MambaSpec, ModelDims, ModelSpec, StateTensorSpec

__all__ = [
    "INEXACT",
    "TESTED_ARCHITECTURES",
    "HFLayout",
    "UnsupportedModelError",
    "architecture",
    "decoder_layers",
    "derive_layout",
    "hf_config",
    "refuse_unsupported",
    "running_layer",
]

INEXACT: dict[str, tuple[str, str]] = {
    "jamba": ("its torch Mamba path restarts the recurrent scan at zero for multi-token input",
              "a Mamba path that continues the scan from the cached state"),
    "zamba": ("its torch Mamba path restarts the recurrent scan at zero for multi-token input",
              "a Mamba path that continues the scan from the cached state"),
    "mamba": ("its torch path restarts the recurrent scan at zero for multi-token input "
              "and it keeps a cache class of its own",
              "a scan that continues from the cached state, in transformers' standard cache"),
    "falcon_mamba": ("its torch path restarts the recurrent scan at zero for multi-token input "
                     "and it keeps a cache class of its own",
                     "a scan that continues from the cached state, in transformers' standard "
                     "cache"),
    "recurrent_gemma": ("it keeps its recurrent state on the modules, not in a cache",
                        "its state moved into transformers' standard cache layers"),
    "moshi": ("its text model masks attention fully causally while its cache keeps only a "
              "sliding window, so a continuation from its cache sees fewer tokens than a cold "
              "prefill (max |delta logprob| 0.16 measured on a tiny config)",
              "one attention mask for cold and cached forwards (a sliding-window mask)"),
}
"""Architectures whose continuation from a cache is known not to equal a cold
prefill on the torch path (measured with transformers 5.24): ``arch: (why,
what support would take)``."""

TESTED_ARCHITECTURES: tuple[str, ...] = (
    "afmoe", "bailing_hybrid", "bamba", "beam", "cohere2", "cohere2_moe", "cwm", "doge", "dots1",
    "exaone4", "exaone_moe", "falcon_h1", "flint", "gemma2", "gemma3_text", "gemma3n_text",
    "gemma4_text", "gemma4_unified_text", "gpt_oss", "granite_swa", "granitemoe_swa",
    "granitemoehybrid", "inkling2_loop_text", "inkling2_text", "inkling_text", "kimi_linear",
    "kolibri1", "laguna", "lara_mini", "lfm2", "lfm2_moe", "lfm3", "llama4_text", "mamba2",
    "mellum", "mimo_v2_flash", "ministral", "ministral3", "mistral", "mixtral",
    "modernbert-decoder", "nemotron_h", "olmo3", "olmo_hybrid", "phi3", "phimoe", "qwen2",
    "qwen2_moe", "qwen3", "qwen3_5", "qwen3_5_moe", "qwen3_5_moe_text", "qwen3_5_text",
    "qwen3_moe", "qwen3_next", "smollm3", "starcoder2", "vaultgemma", "zamba2", "zaya",
)
"""Every hybrid (recurrent + attention), recurrent-only and sliding-window
architecture of transformers 5.24 that ``TransformersModel`` accepts, each
checked on a tiny seeded config by ``tests/engine/model/test_model_hf_archs.py``
(the one list: the README prints it from here): a restore equals LayerLift's
own recompute bit for bit, and a cold prefill equals transformers' own
forward (in float64, on every CPU kernel set). Multimodal wrappers are
listed by their text decoder (``gemma3_text`` for ``gemma3``); ``qwen3_5``
and ``qwen3_5_moe`` run whole, being small."""

_DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}


class UnsupportedModelError(ValueError):
    """LayerLift cannot restore this model exactly; raised by the
    :class:`~layerlift.engine.model.hf.TransformersModel` constructor (never
    at a prefill). ``architecture`` is the config's ``model_type``, ``layer``
    the decoder layer(s) concerned (``None``: the whole model), ``reason``
    why, ``need`` what support would take."""

    def __init__(self, architecture: str, reason: str, need: str,
                 layer: int | str | None = None) -> None:
        self.architecture, self.reason, self.need, self.layer = architecture, reason, need, layer
        where = "" if layer is None else f" (decoder layer {layer})"
        super().__init__(f"LayerLift cannot restore {architecture!r}{where}: {reason}. "
                         f"Support would take {need}.")


@dataclass(frozen=True)
class HFLayout:
    """The cache spec of a transformers model and how it maps onto its layers.

    ``groups[i]`` are the cache layers (indices into ``spec.kinds``) of
    decoder layer ``i`` (empty for a layer without a cache); ``states`` names
    each recurrent state tensor as ``("conv" | "recurrent", state_idx)`` in
    ``spec.mamba.tensors`` order."""

    spec: ModelSpec
    groups: tuple[tuple[int, ...], ...]
    states: tuple[tuple[str, int], ...]


def hf_config(hf_model: nn.Module) -> Any:
    """The model's ``PretrainedConfig`` (typed ``Any``: transformers' configs
    are dynamic)."""
    return hf_model.config


def architecture(hf_model: nn.Module) -> str:
    """The model's ``model_type`` (its text decoder's, for a multimodal one)."""
    cfg = hf_config(hf_model)
    text = cfg.get_text_config(decoder=True)
    return str(getattr(text, "model_type", "") or getattr(cfg, "model_type", "") or
               type(hf_model).__name__)


def decoder_layers(hf_model: nn.Module, n: int) -> nn.ModuleList:
    """The decoder's ``layers`` list, one module per cache layer object:
    ``get_decoder().layers``, else the one ``*.layers`` module list of ``n``
    modules (some models' ``get_decoder`` returns another module). Raises
    :class:`UnsupportedModelError` when there is none."""
    model: Any = hf_model
    decoder = model.get_decoder() if hasattr(model, "get_decoder") else None
    layers = getattr(decoder, "layers", None)
    if not isinstance(layers, nn.ModuleList) or len(layers) < n:
        found = [m for name, m in hf_model.named_modules()
                 if name.rsplit(".", 1)[-1] == "layers" and isinstance(m, nn.ModuleList)
                 and len(m) == n]
        layers = found[0] if len(found) == 1 else None
    if not isinstance(layers, nn.ModuleList) or len(layers) < n:
        raise UnsupportedModelError(
            architecture(hf_model), f"{type(hf_model).__name__} has no decoder `layers` list "
            f"matching its {n} cache layers, so LayerLift cannot hook its layers",
            "the decoder's layers exposed as `get_decoder().layers`")
    return layers


@contextmanager
def running_layer(layers: nn.ModuleList) -> Iterator[list[int | None]]:
    """While open, ``at[0]`` is the decoder layer running (``None`` outside
    every layer), so a forward that fails can be blamed on its layer."""
    at: list[int | None] = [None]
    handles = []
    for i, module in enumerate(layers):
        def enter(_m: nn.Module, _a: Any, _i: int = i) -> None:
            at[0] = _i

        def leave(_m: nn.Module, _a: Any, _o: Any) -> None:
            at[0] = None

        handles += [module.register_forward_pre_hook(enter), module.register_forward_hook(leave)]
    try:
        yield at
    finally:
        for h in handles:
            h.remove()


def _standard_classes() -> dict[type, str]:
    from transformers import cache_utils as cu

    return {
        cu.DynamicLayer: "F",
        cu.DynamicSlidingWindowLayer: "S",
        cu.LinearAttentionLayer: "M",
        cu.LinearAttentionAndFullAttentionLayer: "MF",
        cu.LinearAttentionAndSlidingWindowAttentionLayer: "MS",
        cu.DummyLayer: "",
    }


def refuse_unsupported(hf_model: nn.Module) -> None:
    """:class:`UnsupportedModelError` for a model known, before any probe,
    not to restore exactly: a known-inexact torch path, or a forward without
    transformers' standard ``cache`` argument."""
    arch = architecture(hf_model)
    if arch in INEXACT:
        reason, need = INEXACT[arch]
        raise UnsupportedModelError(arch, f"{reason}, so a restored prefill would not equal a "
                                    "cold one", need)
    if "cache" not in inspect.signature(type(hf_model).forward).parameters:
        raise UnsupportedModelError(
            arch, f"{type(hf_model).__name__}.forward takes no `cache` argument, so its state "
            "cannot be filled layer by layer", "a forward that takes transformers' standard Cache")


def _new_cache(hf_model: nn.Module) -> Any:
    from transformers import DynamicCache

    arch = architecture(hf_model)
    try:
        cache = DynamicCache(config=hf_config(hf_model))
    except Exception as e:  # transformers' own refusal, in its words
        raise UnsupportedModelError(
            arch, f"transformers cannot build its standard DynamicCache for it "
            f"({type(e).__name__}: {e})", "a cache LayerLift can map onto its pools") from e
    classes = _standard_classes()
    for i, layer in enumerate(cache.layers):
        if type(layer) not in classes:
            raise UnsupportedModelError(
                arch, f"its cache layer class {type(layer).__name__} is not one of transformers' "
                "standard ones (full, sliding, linear attention, their combinations, dummy), so "
                "LayerLift does not know where all of its state lives",
                f"a mapping of {type(layer).__name__}'s tensors onto FULL/SWA/MAMBA pages in "
                "engine/model/hf_layout.py", layer=i)
    return cache


def _states(layer: Any) -> tuple[list[StateTensorSpec], list[tuple[str, int]]]:
    specs, names = [], []
    for j in range(layer.number_of_states):
        for attr in ("conv", "recurrent"):
            if getattr(layer, f"is_{attr}_states_initialized")[j]:
                t = getattr(layer, f"{attr}_states")[j]
                specs.append(StateTensorSpec(f"{attr}{j}", tuple(t.shape[1:]), t.dtype))
                names.append((attr, j))
    return specs, names


def _one(arch: str, values: dict[Any, list[int]], what: str, need: str,
         show: Callable[[Any], str] = str) -> Any:
    """The one value every layer has; refuses naming the layers that differ."""
    if len(values) > 1:
        seen = "; ".join(f"{show(v)} at decoder layers {ls}" for v, ls in values.items())
        first_odd = list(values.values())[1][0]
        raise UnsupportedModelError(arch, f"its layers differ in {what} ({seen}) and LayerLift's "
                                    "pools hold one per component", need, layer=first_odd)
    return next(iter(values)) if values else None


def _probe(hf_model: nn.Module, cache: Any, layers: nn.ModuleList) -> set[int]:
    """Run two tokens into ``cache``; the decoder layers whose attention wrote
    its cache layer through ``update`` (the only write LayerLift sees)."""
    arch = architecture(hf_model)
    written: set[int] = set()
    for i, layer in enumerate(cache.layers):
        if hasattr(layer, "keys") and hasattr(layer, "update"):
            inner = layer.update

            def update(k: Any, v: Any, *args: Any, _i: int = i, _inner: Any = inner,
                       **kwargs: Any) -> Any:
                written.add(_i)
                return _inner(k, v, *args, **kwargs)

            layer.update = update
    device = next(hf_model.parameters()).device
    n = len(cache.layers)
    try:
        with running_layer(layers) as at:
            hf_model(input_ids=torch.zeros(1, 2, dtype=torch.int64, device=device), cache=cache,
                     use_cache=True)
    except Exception as e:
        raise UnsupportedModelError(
            arch, f"its forward rejects transformers' standard DynamicCache "
            f"({type(e).__name__}: {e})",
            "an adapter for the model's own cache class (or the model moved onto "
            "transformers' standard cache layers)", layer=at[0]) from e
    if len(cache.layers) != n:
        raise UnsupportedModelError(
            arch, f"its forward adds cache layers as it runs ({n} before, {len(cache.layers)} "
            "after: layers looped over their own copies of the cache), which fixed pages per "
            "decoder layer cannot hold", "one page layout per loop of the looped layers",
            layer=f"{n}..{len(cache.layers) - 1}")
    for layer in cache.layers:
        layer.__dict__.pop("update", None)
    return written


@torch.inference_mode()
def derive_layout(hf_model: nn.Module, page_size: int, track_interval: int) -> HFLayout:
    """Probe ``hf_model`` (two tokens, a fresh cache) and build its layout.
    Raises :class:`UnsupportedModelError` (a ``ValueError`` saying why and
    what support would take) for a model LayerLift cannot restore, and
    ``ValueError`` for paging that does not fit the model."""
    refuse_unsupported(hf_model)
    arch = architecture(hf_model)
    cache = _new_cache(hf_model)
    try:
        layers = decoder_layers(hf_model, len(cache.layers))
    except UnsupportedModelError as no_layers:  # the probe may find a deeper reason first
        _probe(hf_model, cache, nn.ModuleList())
        raise no_layers
    written = _probe(hf_model, cache, layers)
    classes = _standard_classes()
    letters: list[str] = []
    groups: list[tuple[int, ...]] = []
    shapes: list[KVShape] = []
    dtypes: dict[torch.dtype, list[int]] = {}
    windows: dict[int, list[int]] = {}
    states: dict[tuple[tuple[StateTensorSpec, ...], tuple[tuple[str, int], ...]], list[int]] = {}
    for i, layer in enumerate(cache.layers):
        kinds = classes[type(layer)]
        groups.append(tuple(range(len(letters), len(letters) + len(kinds))))
        letters.extend(kinds)
        if "M" in kinds:
            specs, state_names = _states(layer)
            if not specs:
                raise UnsupportedModelError(
                    arch, "its recurrent cache layer holds no state after a forward (the mixer "
                    "keeps its state elsewhere)", "the state kept in the cache layer", layer=i)
            states.setdefault((tuple(specs), tuple(state_names)), []).append(i)
        if "F" in kinds or "S" in kinds:
            keys, values = getattr(layer, "keys", None), getattr(layer, "values", None)
            if i not in written or keys is None or values is None or keys.dim() != 4 \
                    or values.dim() != 4:
                raise UnsupportedModelError(
                    arch, "its attention does not write [batch, heads, tokens, width] keys and "
                    "values through its cache layer's update(), so LayerLift cannot capture them",
                    "the layer's attention cached through Cache.update", layer=i)
            shapes.append(KVShape(int(keys.shape[1]), int(keys.shape[3]),
                                  int(values.shape[1]), int(values.shape[3])))
            if keys.dtype != values.dtype:
                raise UnsupportedModelError(
                    arch, f"its keys ({keys.dtype}) and values ({values.dtype}) differ in dtype",
                    "one dtype per page object", layer=i)
            dtypes.setdefault(keys.dtype, []).append(i)
        if "S" in kinds:
            windows.setdefault(int(layer.sliding_window), []).append(i)
    if not letters:
        raise UnsupportedModelError(arch, "it has no cache layer, so there is nothing to restore",
                                    "a model that caches")
    kv_dtype = _one(arch, dtypes, "KV dtype", "one page object per dtype")
    window = _one(arch, windows, "sliding window", "one SWA component per window size")
    state, names = _one(arch, states, "recurrent state layout",
                        "a per-layer recurrent state layout in the MAMBA slot",
                        show=lambda key: ", ".join(
                            f"{t.name} {list(t.shape)} {str(t.dtype).removeprefix('torch.')}"
                            for t in key[0])) or ((), ())
    dtype = torch.float32 if kv_dtype is None else kv_dtype
    if dtype not in _DTYPE_NAMES:
        raise UnsupportedModelError(arch, f"its KV dtype {dtype} is not one LayerLift pages",
                                    f"support for {dtype} in pools/spec.py")
    window = window or page_size
    if window % page_size:
        raise ValueError(f"the sliding window of {arch!r} ({window} tokens) must be a multiple "
                         f"of page_size ({page_size}): choose a page size that divides it")
    text = hf_config(hf_model).get_text_config(decoder=True)
    first = shapes[0] if shapes else KVShape.uniform(1, 1)
    spec = ModelSpec(
        # For information only (the pools never read dims; ModelSpec.vocab_size is deprecated).
        dims=ModelDims(vocab_size=int(text.vocab_size), hidden_size=int(text.hidden_size)),
        layers="".join(letters), num_kv_heads=first.k_heads, head_dim=first.k_dim,
        page_size=page_size, swa_window=window, track_interval=track_interval,
        dtype=_DTYPE_NAMES[dtype], state=MambaSpec(state) if state else None,
        kv_shapes=tuple(shapes), name=arch,
    )
    return HFLayout(spec, tuple(groups), names)
