"""Tiny transformers models for the adapter's tests (seeded random weights,
nothing downloaded)."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from layerlift.engine.model.hf import TransformersModel
from layerlift.pools.spec import Component

__all__ = ["CONFIGS", "build", "cold_logprobs"]

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


def hf_model(arch: str, seed: int = 0) -> nn.Module:
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.for_model(arch, **CONFIGS[arch])
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()


@torch.no_grad()
def rerandomise_recurrent(model: TransformersModel, seed: int = 1) -> None:
    """Default init makes a tiny model's recurrent state nearly irrelevant to
    its logits; redraw every weight of the recurrent decoder layers' mixers
    (slow decay, strong in/out projections) so the state matters."""
    g = torch.Generator().manual_seed(seed)
    layers = model.hf.get_decoder().layers  # type: ignore[operator]
    for group, layer in zip(model.layout.groups, layers, strict=False):
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


@torch.no_grad()
def cold_logprobs(model: TransformersModel, tokens: Any) -> torch.Tensor:
    """transformers' own cold ``model(full_ids)``: next-token log-probs."""
    ids = torch.as_tensor(tokens, dtype=torch.int64)[None]
    return torch.log_softmax(model.hf(ids).logits[0, -1].float(), dim=-1)
