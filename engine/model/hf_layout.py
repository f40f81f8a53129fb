"""The cache layout of a transformers model, derived from its standard cache layers.

transformers (5.24) builds ``DynamicCache(config=cfg)`` as one layer object
per decoder layer, chosen from a small set of standard classes: full
attention (``DynamicLayer``), sliding window (``DynamicSlidingWindowLayer``),
linear attention / recurrent (``LinearAttentionLayer``: conv and recurrent
states), the combined attention + recurrent layers, and ``DummyLayer`` for
layers without a cache (MLP, MoE). The layout is read from those objects
after a two-token probe forward (recurrent states are created lazily, so
their shapes and dtypes are only known once a layer ran), never from a table
of architectures: any model built on these classes maps onto FULL, SWA and
MAMBA cache layers.

A decoder layer that holds both a recurrent state and KV becomes two cache
layers (MAMBA then FULL/SWA) that share one decoder layer.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from layerlift.pools.spec import MambaSpec, ModelDims, ModelSpec, StateTensorSpec

__all__ = ["INEXACT", "HFLayout", "derive_layout", "hf_config", "refuse_unsupported"]

INEXACT: dict[str, str] = {
    "jamba": "its torch Mamba path restarts the recurrent scan at zero for multi-token input",
    "zamba": "its torch Mamba path restarts the recurrent scan at zero for multi-token input",
    "mamba": "its torch path restarts the recurrent scan at zero for multi-token input "
             "(and it keeps a custom cache class)",
    "falcon_mamba": "its torch path restarts the recurrent scan at zero for multi-token input "
                    "(and it keeps a custom cache class)",
    "recurrent_gemma": "it keeps its recurrent state on the modules, not in a cache",
}
"""Architectures whose continuation from a cache is known not to equal a cold
prefill on the torch path (measured with transformers 5.24), and why."""

_DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}


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
    """``ValueError`` saying why, for a model LayerLift cannot restore exactly."""
    cfg = hf_config(hf_model)
    text = cfg.get_text_config(decoder=True)
    kind = str(getattr(text, "model_type", getattr(cfg, "model_type", "")))
    if kind in INEXACT:
        raise ValueError(f"{kind} is not supported: {INEXACT[kind]}, so a restored prefill "
                         "would not equal a cold one")
    if "cache" not in inspect.signature(type(hf_model).forward).parameters:
        raise ValueError(f"{type(hf_model).__name__}.forward takes no `cache` argument: the "
                         "model does not use transformers' standard Cache, so its state "
                         "cannot be filled layer by layer")


def _new_cache(hf_model: nn.Module) -> Any:
    from transformers import DynamicCache

    cache = DynamicCache(config=hf_config(hf_model))
    classes = _standard_classes()
    for i, layer in enumerate(cache.layers):
        if type(layer) not in classes:
            raise ValueError(
                f"decoder layer {i} uses the cache layer class {type(layer).__name__}, not one of "
                "transformers' standard ones (full, sliding, linear attention, their combinations, "
                "dummy): LayerLift does not know where its state lives"
            )
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


def _one(values: set[Any], what: str) -> Any:
    if len(values) > 1:
        raise ValueError(f"layers of this model differ in {what} ({sorted(map(str, values))}); "
                         "LayerLift's pools need one value per component")
    return values.pop() if values else None


@torch.inference_mode()
def derive_layout(hf_model: nn.Module, page_size: int, track_interval: int) -> HFLayout:
    """Probe ``hf_model`` (two tokens, a fresh cache) and build its layout.
    Raises ``ValueError`` (saying why) for an unsupported model."""
    refuse_unsupported(hf_model)
    cache = _new_cache(hf_model)
    device = next(hf_model.parameters()).device
    hf_model(input_ids=torch.zeros(1, 2, dtype=torch.int64, device=device), cache=cache,
             use_cache=True)
    classes = _standard_classes()
    letters: list[str] = []
    groups: list[tuple[int, ...]] = []
    kv: set[tuple[int, int, torch.dtype]] = set()
    windows: set[int] = set()
    states: set[tuple[tuple[StateTensorSpec, ...], tuple[tuple[str, int], ...]]] = set()
    for layer in cache.layers:
        kinds = classes[type(layer)]
        groups.append(tuple(range(len(letters), len(letters) + len(kinds))))
        letters.extend(kinds)
        if "M" in kinds:
            specs, state_names = _states(layer)
            states.add((tuple(specs), tuple(state_names)))
        if "F" in kinds or "S" in kinds:
            kv.add((int(layer.keys.shape[1]), int(layer.keys.shape[3]), layer.keys.dtype))
        if "S" in kinds:
            windows.add(int(layer.sliding_window))
    if not letters:
        raise ValueError("this model has no cache layer: there is nothing to restore")
    kv_heads, head_dim, kv_dtype = _one(kv, "KV heads, head dim or KV dtype") or (1, 1, None)
    window = _one(windows, "sliding window") or page_size
    state, names = _one(states, "recurrent state layout") or ((), ())
    dtype = torch.float32 if kv_dtype is None else kv_dtype
    if dtype not in _DTYPE_NAMES:
        raise ValueError(f"KV dtype {dtype} is not supported; use one of {list(_DTYPE_NAMES)}")
    if window % page_size:
        raise ValueError(f"the sliding window ({window} tokens) must be a multiple of "
                         f"page_size ({page_size}): choose a page size that divides it")
    text = hf_config(hf_model).get_text_config(decoder=True)
    spec = ModelSpec(
        # For information only (the pools never read dims; ModelSpec.vocab_size is deprecated).
        dims=ModelDims(vocab_size=int(text.vocab_size), hidden_size=int(text.hidden_size)),
        layers="".join(letters), num_kv_heads=kv_heads, head_dim=head_dim, page_size=page_size,
        swa_window=window, track_interval=track_interval, dtype=_DTYPE_NAMES[dtype],
        state=MambaSpec(state) if state else None,
        name=str(getattr(hf_config(hf_model), "model_type", "hf")),
    )
    return HFLayout(spec, tuple(groups), names)

