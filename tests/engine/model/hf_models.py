"""Tiny transformers models for the adapter's tests (seeded random weights,
nothing downloaded), and their float64 copies for the adapter-fidelity oracle."""

from __future__ import annotations

import functools
from typing import Any

import torch
from torch import nn

from layerlift.engine.model.hf import TransformersModel
from layerlift.pools.spec import Component

__all__ = ["CONFIGS", "build", "build_float64", "cold_logprobs", "tiny_kwargs", "to_float64"]

_COMMON: dict[str, Any] = dict(vocab_size=128, hidden_size=64, num_hidden_layers=4,
                               num_attention_heads=4, num_key_value_heads=2)

CONFIGS: dict[str, dict[str, Any]] = {
    # gated DeltaNet + sliding window + full attention, in separate layers
    "lara_mini": dict(
        _COMMON, head_dim=16, linear_conv_kernel_dim=4, linear_key_head_dim=16,
        linear_value_head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4,
        moe_intermediate_size=32, shared_expert_intermediate_size=32, num_experts=4,
        num_experts_per_tok=2, sliding_window=32, eos_token_id=0,
    ),
    # Mamba-2 + full attention (+ an MLP-only layer without a cache)
    "nemotron_h": dict(
        _COMMON, head_dim=16, layers_block_type=["mamba", "attention", "mamba", "mlp"],
        intermediate_size=64, mamba_num_heads=4, mamba_head_dim=16, ssm_state_size=16,
        n_groups=2, expand=1, chunk_size=16,
    ),
    # sliding window + full attention
    "gpt_oss": dict(
        _COMMON, head_dim=16, intermediate_size=64, num_local_experts=4, num_experts_per_tok=2,
        sliding_window=32,
    ),
    # short convolution (conv state only) + full attention
    "lfm2": dict(_COMMON, intermediate_size=64,
                 layer_types=["conv", "full_attention", "conv", "full_attention"]),
    # KDA linear attention + MLA full attention; the cache holds MLA's compressed
    # latent: keys [1 head, kv_lora_rank] and values [1 head, qk_rope_head_dim]
    "kimi_linear": dict(
        _COMMON, num_key_value_heads=4, intermediate_size=64, moe_intermediate_size=32,
        kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16,
        layer_types=["linear_attention", "full_attention"] * 2,
        linear_attn_config={"head_dim": 16, "num_heads": 4, "short_conv_kernel_size": 4,
                            "kda_layers": [1, 3], "full_attn_layers": [2, 4]},
        num_local_experts=4, num_experts_per_tok=2, first_k_dense_replace=1,
        pad_token_id=0, bos_token_id=1, eos_token_id=2,
    ),
}


# Every other tested architecture: these sizes, for the fields its config has
# (transformers' defaults otherwise), a layer pattern cut from its default one
# when that mixes kinds (the four consecutive layers with the most kinds; else
# the config derives it), sliding window 32.
_TINY: dict[str, Any] = dict(
    _COMMON, head_dim=16, intermediate_size=64, moe_intermediate_size=32,
    shared_expert_intermediate_size=32, num_experts=4, num_local_experts=4, n_routed_experts=4,
    num_experts_per_tok=2, n_shared_experts=1, sliding_window=32, pad_token_id=0,
    bos_token_id=1, eos_token_id=2, linear_key_head_dim=16, linear_value_head_dim=16,
    linear_num_key_heads=2, linear_num_value_heads=4, linear_conv_kernel_dim=4,
    mamba_num_heads=4, mamba_head_dim=16, mamba_n_heads=4, mamba_d_head=16, mamba_d_state=16,
    mamba_d_conv=4, mamba_expand=1, ssm_state_size=16, state_size=16, n_groups=2,
    mamba_n_groups=2, expand=1, chunk_size=16, conv_kernel=4, kv_lora_rank=32, q_lora_rank=16,
    qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, first_k_dense_replace=1,
    n_group=1, topk_group=1, global_head_dim=16, num_global_key_value_heads=2,
    hidden_size_per_layer_input=16, vocab_size_per_layer_input=128, laurel_rank=8,
    altup_num_inputs=2, intermediate_size_mlp=64, num_kv_shared_layers=0,
    use_sliding_window=True, max_window_layers=2, attention_chunk_size=32,
)
_OVERRIDES: dict[str, dict[str, Any]] = {
    "zaya": dict(num_experts_per_tok=1),
    "gemma3n_text": dict(activation_sparsity_pattern=[0.0] * 4),
    "mamba2": dict(num_heads=4, head_dim=16),
    "bamba": dict(attn_layer_indices=[1, 3]),
    "granitemoehybrid": dict(layer_types=["linear_attention", "full_attention"] * 2),
    "falcon_h1": dict(mamba_d_ssm=64),
    "bailing_hybrid": dict(layer_types=["linear_attention", "full_attention"] * 2,
                           num_key_value_heads=4),
    # MLA (full attention only): the cache holds the latent, like Kimi Linear's
    "deepseek_v3": dict(head_dim=8, num_key_value_heads=4),
    "laguna": dict(layer_types=["sliding_attention", "full_attention"] * 2),
    "mellum": dict(layer_types=["sliding_attention", "full_attention"] * 2),
    "lfm2_moe": dict(layer_types=["conv", "full_attention"] * 2),
    # the config's own 4-layer pattern: cut from the default one, its layers'
    # conv states differ in width (a refusal, see test_model_hf_refusals.py)
    **{arch: dict(layer_types=None, swa_num_attention_heads=4, swa_num_key_value_heads=2,
                  swa_head_dim=16, sliding_window_size=32)
       for arch in ("inkling_text", "inkling2_text", "inkling2_loop_text")},
    # full layers twice as wide as sliding ones: K/V widths differ per layer
    "gemma4_text": dict(global_head_dim=32, layer_types=["sliding_attention",
                                                         "full_attention"] * 2),
}


def tiny_kwargs(arch: str) -> dict[str, Any]:
    """The tiny config of ``arch`` (``CONFIGS`` or the generic sizes above)."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    if arch in CONFIGS:
        return CONFIGS[arch]
    default = CONFIG_MAPPING[arch]()
    text = default.get_text_config(decoder=True)
    if text is not default:  # a multimodal wrapper: shrink its text decoder only
        nested = text.to_dict()
        nested.pop("layer_types", None)  # derived again for four layers
        nested.update({k: v for k, v in _TINY.items() if k in nested})
        return {"text_config": nested, **_OVERRIDES.get(arch, {})}
    def settable(name: str) -> bool:
        target = getattr(default, "attribute_map", {}).get(name, name)
        if isinstance(getattr(type(default), target, None), property):
            return False
        return name in type(default).__dataclass_fields__ or name in vars(default)

    kw = {k: v for k, v in _TINY.items() if settable(k)}
    for name in ("layer_types", "layers_block_type"):
        pattern = getattr(default, name, None)
        if settable(name) and isinstance(pattern, list) and len(set(pattern)) > 1:
            windows = [pattern[i:i + 4] for i in range(len(pattern) - 3)]
            kw[name] = max(windows, key=lambda w: len(set(w)))  # first with most kinds
    return {**kw, **_OVERRIDES.get(arch, {})}


def hf_model(arch: str, seed: int = 0) -> nn.Module:
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.for_model(arch, **tiny_kwargs(arch))
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()


@torch.no_grad()
def rerandomise_recurrent(model: TransformersModel, seed: int = 1) -> None:
    """Default init makes a tiny model's recurrent state nearly irrelevant to
    its logits; redraw every weight of the recurrent decoder layers' mixers
    (slow decay, strong in/out projections) so the state matters."""
    g = torch.Generator().manual_seed(seed)
    for group, layer in zip(model.layout.groups, model.decoder_layers, strict=False):
        if not any(model.spec.kinds[g_] is Component.MAMBA for g_ in group):
            continue
        for name, p in layer.named_parameters():
            if "norm" in name and "mixer" not in name and "linear_attn" not in name:
                continue
            noise = torch.randn(p.shape, generator=g, dtype=torch.float32)
            if name.endswith("A_log"):
                p.copy_(torch.log(0.02 + 0.1 * noise.abs()))  # decay near 1: a long memory
            elif name.endswith("dt_bias"):
                p.copy_(-2.0 + 0.1 * noise)
            else:
                p.copy_(noise * (0.5 / max(1, p.shape[-1]) ** 0.5 if p.dim() > 1 else 0.1)
                        + (1.0 if "norm" in name else 0.0))


def build(arch: str, seed: int = 0) -> TransformersModel:
    model = TransformersModel(hf_model(arch, seed), name=f"tiny-{arch}", revision=f"s{seed}")
    rerandomise_recurrent(model, seed + 1)
    return model


# Routers whose forward computes in float32 whatever the model's dtype (it casts
# its input with ``.float()``): the float64 copy keeps their weights float32.
_FLOAT32_ROUTERS = ("Inkling2TopKRouter", "Inkling2LoopTopKRouter")


def build_float64(arch: str, seed: int = 0) -> tuple[TransformersModel, list[float]]:
    """``build(arch, seed)`` computing in float64 (see :func:`to_float64`)."""
    model = build(arch, seed)
    return model, to_float64(model)


def to_float64(model: TransformersModel) -> list[float]:
    """Make ``model`` compute in float64, in place: the same weights (the
    float32 values widened), experts run eagerly (``grouped_mm`` has no
    float64 kernel), routers of ``_FLOAT32_ROUTERS`` left in float32.

    For cold prefills only from then on: its spec still pages float32
    (LayerLift pages no float64), which a cold prefill never reads back (it
    continues from its own cache between chunks; what it writes into the
    pool is rounded there and unused), while a restore would start from
    float32 pages. Returns a list to which every call of a float32 router
    appends its smallest gap between the k-th and the (k+1)-th expert score.
    """
    hf: Any = model.hf
    hf.set_experts_implementation("eager")
    hf.double()
    margins: list[float] = []
    for module in hf.modules():
        if type(module).__name__ in _FLOAT32_ROUTERS:
            module.float()
            module.register_forward_hook(functools.partial(_record_margin, margins))
    return margins


def _record_margin(margins: list[float], router: Any, args: Any, output: Any) -> None:
    scores = router.score_fn(output[0]) + router.e_score_correction_bias  # what topk ranks
    top = scores.topk(router.top_k + 1, dim=-1).values
    margins.append(float((top[:, -2] - top[:, -1]).min()))


@torch.no_grad()
def cold_logprobs(model: TransformersModel, tokens: Any) -> torch.Tensor:
    """transformers' own cold ``model(full_ids)``: next-token log-probs."""
    ids = torch.as_tensor(tokens, dtype=torch.int64)[None]
    return torch.log_softmax(model.hf(ids).logits[0, -1].float(), dim=-1)
