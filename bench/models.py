"""The models a benchmark can run, by name.

* a preset name (``tiny``, ``small``, ...): the reference
  :class:`~layerlift.engine.model.HybridModel` of that preset, seed 0;
* ``hf:<arch>``: a tiny transformers model of that architecture with seeded
  random weights (``hf:lara_mini``, ``hf:nemotron_h``, ``hf:gpt_oss``,
  ``hf:lfm2``; nothing is downloaded; needs the ``hf`` extra);
* ``hf:<directory>``: ``TransformersModel.from_pretrained`` of a local directory.

Paging of the transformers models: 64-token pages, a checkpoint every 128
tokens (the ``small`` preset's), so the benchmark's prefix grid applies.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from layerlift.engine.model import HybridModel, Model
from layerlift.pools.spec import ModelSpec

__all__ = ["HF_TINY", "build_model", "tiny_transformers"]

_BASE: dict[str, Any] = dict(vocab_size=512, hidden_size=128, num_hidden_layers=8,
                             num_attention_heads=4, num_key_value_heads=2, head_dim=32)

HF_TINY: dict[str, dict[str, Any]] = {
    "lara_mini": dict(
        _BASE, linear_conv_kernel_dim=4, linear_key_head_dim=32, linear_value_head_dim=32,
        linear_num_key_heads=2, linear_num_value_heads=4, moe_intermediate_size=64,
        shared_expert_intermediate_size=64, num_experts=4, num_experts_per_tok=2,
        sliding_window=256, eos_token_id=0,
    ),
    "nemotron_h": dict(
        _BASE, layers_block_type=["mamba", "attention", "mamba", "mlp"] * 2,
        intermediate_size=256, mamba_num_heads=4, mamba_head_dim=32, ssm_state_size=32,
        n_groups=2, expand=1, chunk_size=64,
    ),
    "gpt_oss": dict(_BASE, intermediate_size=256, num_local_experts=4, num_experts_per_tok=2,
                    sliding_window=256),
    "lfm2": dict(_BASE, intermediate_size=256, layer_types=["conv", "full_attention"] * 4),
}
"""Tiny configs of transformers architectures LayerLift restores exactly."""

PAGE_SIZE = 64
TRACK_INTERVAL = 128


def tiny_transformers(arch: str, seed: int = 0, device: str | torch.device = "cpu") -> Model:
    """A :class:`TransformersModel` of ``HF_TINY[arch]``, weights drawn with ``seed``."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from layerlift.engine.model.hf import TransformersModel

    if arch not in HF_TINY:
        raise ValueError(f"no tiny config for {arch!r}; choose one of {sorted(HF_TINY)} "
                         "or give hf:<local directory>")
    torch.manual_seed(seed)
    config = AutoConfig.for_model(arch, **HF_TINY[arch])
    hf: Any = AutoModelForCausalLM.from_config(config, dtype=torch.float32)  # type: ignore[no-untyped-call]
    return TransformersModel(hf.to(device), name=f"tiny-{arch}", revision=f"seed{seed}",
                             page_size=PAGE_SIZE, track_interval=TRACK_INTERVAL)


def build_model(name: str, device: str | torch.device = "cpu") -> Model:
    """The model called ``name`` (see the module docstring); ``ValueError``
    for an unknown name."""
    if name.startswith("hf:"):
        target = name.removeprefix("hf:")
        if Path(target).is_dir():
            from layerlift.engine.model.hf import TransformersModel

            return TransformersModel.from_pretrained(
                target, device=device, page_size=PAGE_SIZE, track_interval=TRACK_INTERVAL)
        return tiny_transformers(target, device=device)
    if name not in ModelSpec.preset_names():
        raise ValueError(f"unknown model {name!r}: a preset ({ModelSpec.preset_names()}), "
                         "hf:<arch> or hf:<directory>")
    return HybridModel(ModelSpec.preset(name), seed=0, device=device)
