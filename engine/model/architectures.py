"""Published hybrid architectures for the simulated model, and their cache
layouts at a token scale.

The numbers are the models' ``config.json`` values (the same defaults
transformers' ``Qwen3NextConfig`` and ``NemotronHConfig`` carry; gpt-oss-20b's
differ from ``GptOssConfig``'s 120b defaults), written here as constants: nothing is
downloaded.

Token scale ``k`` (:func:`simulated_spec`): one simulated token stands for
``k`` real ones. Per simulated token a page holds the *real* per-token KV
bytes (so a pool or store of ``X`` bytes stands for ``k * X`` real bytes),
a recurrent layer's state tensors hold exactly ``1/k`` of their real
elements (their leading dimensions divided by ``k``, merged where the first
alone does not divide: a checkpoint stands for one real checkpoint, at
exactly ``1/k`` of its bytes; a scale that divides no such product is
refused), and
the emulated link runs at ``1/k`` of the real rate: a restore of ``n``
simulated tokens then takes as long as one of ``k * n`` real tokens, and a
checkpoint as long as a real one. The compute model sees ``k * n`` tokens.
The SWA window, page size and checkpoint interval are in simulated tokens
(real values divided by ``k``, at least one page).
"""

from __future__ import annotations

import math

from layerlift.engine.model.compute_model import DEVICES, MoE, Recurrent, RooflineCompute, SeqWork
from layerlift.engine.model.compute_model import Architecture as Arch
from layerlift.pools.spec import Component, MambaSpec, ModelSpec, StateTensorSpec

__all__ = ["ARCHITECTURES", "LLAMA3_8B", "prefill_ms_per_layer", "real_state_bytes",
           "simulated_spec"]

# Qwen/Qwen3-Next-80B-A3B-Instruct config.json (= transformers Qwen3NextConfig
# defaults): hidden_size 2048, 48 layers, layer_types linear x3 + full
# (full_attention_interval 4), 16 query heads, 2 KV heads, head_dim 256,
# gated attention output (q_proj doubled), 512 experts of 512, 10 active, one
# shared expert of 512; gated DeltaNet: 16 key heads, 32 value heads, key and
# value head dim 128, conv kernel 4. in_proj_qkvz + in_proj_ba = 2*2048 +
# 2*4096 + 2*32 outputs; out_proj 4096. Scan per token ~7 * heads * dk * dv
# (decay, S^T k, rank-1 update, q^T S) + the depthwise conv. State per layer:
# conv [8192, 3] bf16 + recurrent [32, 128, 128] fp32 (SGLang keeps the SSM
# state in float32).
_QWEN3_NEXT = Arch(
    name="qwen3-next-80b-a3b",
    source="Qwen/Qwen3-Next-80B-A3B-Instruct config.json",
    pattern="MMMF" * 12, hidden=2048, q_heads=16, kv_heads=2, head_dim=256, window=0,
    mlp_inter=0, moe=MoE(experts=512, active=10, inter=512, shared_inter=512),
    recurrent=Recurrent("gated-deltanet", in_proj=2 * 2048 + 2 * 4096 + 2 * 32, out_proj=4096,
                        scan_flops=7 * 32 * 128 * 128 + 2 * 8192 * 4,
                        state_bytes=8192 * 3 * 2 + 32 * 128 * 128 * 4),
    q_gate=True, default_gpus=4, weights_bytes=80e9 * 2,  # 80 B parameters, BF16
)

# nvidia/Nemotron-H-8B-Base-8K config.json (= NemotronHConfig's Mamba-2
# defaults): hidden_size 4096, 52 layers with hybrid_override_pattern below
# (M Mamba-2, * attention, - MLP), 32 query / 8 KV heads of 128, ReLU^2 MLP
# of 21504 (two matrices); Mamba-2: 128 heads of 64, d_state 128, 8 groups,
# conv kernel 4, expand 2 (d_inner 8192). in_proj = 2*8192 + 2*8*128 + 128;
# scan per token ~6 * heads * head_dim * d_state + conv. State per layer:
# conv [8192 + 2*8*128, 3] bf16 + ssm [128, 64, 128] fp32
# (mamba_ssm_cache_dtype float32).
_NEMOTRON_H = Arch(
    name="nemotron-h-8b",
    source="nvidia/Nemotron-H-8B-Base-8K config.json",
    pattern="M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M-".replace("*", "F"),
    hidden=4096, q_heads=32, kv_heads=8, head_dim=128, window=0,
    mlp_inter=21504, moe=None,
    recurrent=Recurrent("mamba2", in_proj=2 * 8192 + 2 * 8 * 128 + 128, out_proj=8192,
                        scan_flops=6 * 128 * 64 * 128 + 2 * 10240 * 4,
                        state_bytes=10240 * 3 * 2 + 128 * 64 * 128 * 4),
    mlp_with_mixer=False, mlp_gated=False, weights_bytes=8.1e9 * 2,  # ~8.1 B parameters, BF16
)

# openai/gpt-oss-20b config.json: hidden_size 2880, 24 layers alternating
# sliding (window 128) and full attention, 64 query / 8 KV heads of 64, 32
# experts of 2880 (SwiGLU), 4 active, MXFP4 expert weights (~4.25 bits).
_GPT_OSS_20B = Arch(
    name="gpt-oss-20b",
    source="openai/gpt-oss-20b config.json",
    pattern="SF" * 12, hidden=2880, q_heads=64, kv_heads=8, head_dim=64, window=128,
    mlp_inter=0, moe=MoE(experts=32, active=4, inter=2880), recurrent=None,
    expert_weight_bytes=4.25 / 8,
    weights_bytes=13e9,  # the MXFP4 checkpoint, ~13 GB (model card: runs within 16 GB)
)

ARCHITECTURES: dict[str, Arch] = {a.name: a for a in (_QWEN3_NEXT, _NEMOTRON_H, _GPT_OSS_20B)}

# meta-llama/Meta-Llama-3-8B config.json: hidden_size 4096, 32 layers of full
# attention, 32 query / 8 KV heads of 128 (128 KiB of BF16 KV a token), SwiGLU
# MLP of 14336. Not a hybrid (so not one of ARCHITECTURES, the simulated
# model's): the per-layer prefill time of the real-layout host benchmarks.
LLAMA3_8B = Arch(
    name="llama-3-8b", source="meta-llama/Meta-Llama-3-8B config.json",
    pattern="F" * 32, hidden=4096, q_heads=32, kv_heads=8, head_dim=128, window=0,
    mlp_inter=14336, moe=None, recurrent=None, weights_bytes=8.0e9 * 2,
)

# Real state tensors of the recurrent layers: (name, shape, dtype name).
_STATES: dict[str, tuple[tuple[str, tuple[int, ...], str], ...]] = {
    "qwen3-next-80b-a3b": (("conv", (8192, 3), "bfloat16"),
                           ("recurrent", (32, 128, 128), "float32")),
    "nemotron-h-8b": (("conv", (10240, 3), "bfloat16"), ("ssm", (128, 64, 128), "float32")),
}

def _scaled_shape(shape: tuple[int, ...], token_scale: int) -> tuple[int, ...] | None:
    """``shape`` with exactly ``1/token_scale`` of its elements: the shortest
    leading block of dimensions whose product ``token_scale`` divides is
    divided (merged into one dimension), the rest kept; None when
    ``token_scale`` does not divide the element count."""
    lead = 1
    for i, n in enumerate(shape):
        lead *= n
        if lead % token_scale == 0:
            return (lead // token_scale, *shape[i + 1 :])
    return None


def _state(name: str, token_scale: int) -> MambaSpec | None:
    """The state tensors of ``name`` at ``1/token_scale`` of their real
    elements, exactly (``ValueError`` for a scale that does not divide one)."""
    import torch

    if name not in _STATES:
        return None
    dtypes = {"bfloat16": torch.bfloat16, "float32": torch.float32}
    tensors = []
    for tname, shape, dt in _STATES[name]:
        scaled = _scaled_shape(shape, token_scale)
        if scaled is None:
            raise ValueError(
                f"token scale {token_scale} does not divide the {math.prod(shape)} elements of "
                f"{name}'s {tname} state {shape}: its scaled bytes would not be 1/{token_scale} "
                "of the real ones; use a power of two up to 512")
        tensors.append(StateTensorSpec(tname, scaled, dtypes[dt]))
    return MambaSpec(tuple(tensors))


def real_state_bytes(name: str) -> int:
    """Bytes of one real checkpoint of ``name``'s recurrent layers (all
    state tensors of one layer; 0 for a model without them)."""
    import torch

    sizes = {"bfloat16": torch.bfloat16, "float32": torch.float32}
    return sum(math.prod(shape) * sizes[dt].itemsize for _, shape, dt in _STATES.get(name, ()))


def simulated_spec(name: str, *, token_scale: int = 1, page_size: int = 16,
                   track_interval: int | None = None) -> ModelSpec:
    """The cache layout of architecture ``name`` at ``token_scale`` (see the
    module docstring): real KV heads, head dim and BF16 KV per token, state
    tensors with exactly ``1/token_scale`` of their real elements, the SWA
    window ``window / token_scale`` rounded up to a page. ``page_size`` and
    ``track_interval`` (default: one page) are in simulated tokens.
    ``ValueError`` for an unknown name, a scale below 1, or one that does
    not divide a state tensor's element count."""
    if name not in ARCHITECTURES:
        raise ValueError(f"unknown architecture {name!r}; choose one of {sorted(ARCHITECTURES)}")
    if token_scale < 1 or page_size < 1:
        raise ValueError(f"token_scale and page_size must be >= 1, got {token_scale}, {page_size}")
    a = ARCHITECTURES[name]
    window = a.window // token_scale if a.window else page_size
    window = max(page_size, -(-window // page_size) * page_size)
    track = track_interval if track_interval is not None else page_size
    return ModelSpec(layers=a.layers, num_kv_heads=a.kv_heads, head_dim=a.head_dim,
                     page_size=page_size, swa_window=window, track_interval=track,
                     dtype="bfloat16", state=_state(name, token_scale), name=name)


def prefill_ms_per_layer(tokens: int, device: str = "h100") -> float:
    """One Llama-3-8B layer's prefill of ``tokens`` new tokens on ``device``
    (the roofline model), in ms: the host benchmarks' compute stand-in at a
    real layout (``bench sglang``, ``bench vllm``)."""
    roofline = RooflineCompute(LLAMA3_8B, DEVICES[device])
    kinds = [Component.FULL] * len(LLAMA3_8B.layers)
    return roofline.layer_seconds(kinds, [SeqWork(0, tokens)])[0] * 1e3
