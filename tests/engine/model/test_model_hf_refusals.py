"""Architectures ``TransformersModel`` cannot restore exactly are refused at
construction (never at the first prefill) with LayerLift's own
:class:`UnsupportedModelError`: the architecture, the layer where one is to
blame, the reason and what support would take. One case per refusal."""

from __future__ import annotations

from typing import Any

import pytest
from hf_models import tiny_kwargs

from layerlift.engine.model.hf import TransformersModel, UnsupportedModelError

# (architecture, config changes, words of the reason, decoder layer or None)
REFUSALS: list[tuple[str, dict[str, Any], str, object]] = [
    # its own cache class: transformers' forward rejects the standard cache
    ("minimax", {}, "MiniMax uses cache of its own", None),
    ("xlstm", {}, "rejects transformers' standard DynamicCache", None),
    # its own cache layer class inside the standard cache
    ("deepseek_v4", {}, "DeepseekV4HCACache is not one of transformers' standard", 0),
    # no `cache` argument at all: its state is passed around outside a Cache
    ("rwkv", {}, "takes no `cache` argument", None),
    # known-inexact torch paths (the table INEXACT)
    ("jamba", {}, "restarts the recurrent scan at zero", None),
    ("falcon_mamba", {"num_hidden_layers": 2}, "restarts the recurrent scan at zero", None),
    ("recurrent_gemma", {}, "keeps its recurrent state on the modules", None),
    ("moshi", {}, "masks attention fully causally", None),
    # a cache layer class LayerLift cannot map (DSA's indexer keys: a state it cannot see)
    ("deepseek_v32", {}, "DynamicIndexedLayer is not one of transformers' standard", 0),
    # recurrent layers whose states differ in shape (conv widths per layer)
    ("inkling_text", {"layer_types": ["hybrid_sliding"] * 3 + ["hybrid"], "swa_head_dim": 32},
     "differ in recurrent state layout", 3),
    # a looped model: continuing from a filled cache fails in its forward
    ("dory", {}, "cannot continue from a cache", 3),
]


# Its generic tiny config sets a pattern the config cannot take: its own.
_OWN: dict[str, dict[str, Any]] = {
    "recurrent_gemma": dict(vocab_size=128, hidden_size=64, num_hidden_layers=3,
                            num_attention_heads=4, intermediate_size=128, lru_width=64,
                            attention_window_size=32),
}


def _hf(arch: str, changes: dict[str, Any]) -> Any:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    kwargs = {**(_OWN.get(arch) or tiny_kwargs(arch)), **changes}
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(AutoConfig.for_model(arch, **kwargs))


@pytest.mark.parametrize(("arch", "changes", "why", "layer"), REFUSALS,
                         ids=[r[0] for r in REFUSALS])
def test_refused_at_construction_in_layerlifts_words(arch: str, changes: dict[str, Any],
                                                     why: str, layer: object) -> None:
    hf = _hf(arch, changes)
    with pytest.raises(UnsupportedModelError) as info:
        TransformersModel(hf)
    err = info.value
    assert isinstance(err, ValueError)
    assert err.architecture == arch and err.layer == layer
    assert why in err.reason
    text = str(err)
    assert text.startswith(f"LayerLift cannot restore {arch!r}") and "Support would take" in text
    assert err.need and err.need in text
