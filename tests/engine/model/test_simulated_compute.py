"""The compute model's arithmetic against hand-computed cases, the fitted
profile, and the published architectures' cache layouts at a token scale."""

from __future__ import annotations

import math

import pytest
import torch

from layerlift.engine.model.architectures import ARCHITECTURES, real_state_bytes, simulated_spec
from layerlift.engine.model.compute_model import (
    DEVICES,
    UTIL,
    Architecture,
    DeviceProfile,
    FittedCompute,
    KindFit,
    MoE,
    Recurrent,
    RooflineCompute,
    SeqWork,
    attention_pairs,
)
from layerlift.pools.spec import Component

F, S, M = Component.FULL, Component.SWA, Component.MAMBA


@pytest.mark.parametrize(("prefix", "new", "window", "want"), [
    (0, 4, None, 1 + 2 + 3 + 4),
    (3, 2, None, 4 + 5),
    (0, 6, 3, 1 + 2 + 3 + 3 + 3 + 3),
    (5, 3, 4, 4 * 3),          # every query past the window
    (1, 4, 4, 2 + 3 + 4 + 4),  # straddles the window
    (0, 2, 10, 1 + 2),         # window never reached
])
def test_attention_pairs_by_hand(prefix: int, new: int, window: int | None, want: int) -> None:
    assert attention_pairs(prefix, new, window) == want
    brute = sum(min(p + 1, window or p + 1) for p in range(prefix, prefix + new))
    assert brute == want


# A toy architecture small enough to price by hand: hidden 4, 2 query heads
# and 1 KV head of 2, dense gated MLP of 8, a recurrent mixer 4 -> 10 -> 4.
TOY = Architecture(
    name="toy", source="test", pattern="FSM", hidden=4, q_heads=2, kv_heads=1, head_dim=2,
    window=2, mlp_inter=8, moe=None,
    recurrent=Recurrent("toy", in_proj=10, out_proj=4, scan_flops=100, state_bytes=64),
)
DEV = DeviceProfile("toy", peak_flops=1e6, hbm_bytes_per_s=1e6, util=0.5, mem_util=0.5,
                    launch_s=1e-3, source="test")


def test_roofline_full_layer_by_hand() -> None:
    # per token: projections 2*4*(4 + 2*2) + 2*4*4 = 96; MLP 6*4*8 = 192.
    assert TOY.attn_proj_flops() == 96 and TOY.mlp_flops() == 192
    batch = [SeqWork(prefix=2, new=3)]
    flops, nbytes = RooflineCompute(TOY, DEV).layer_flops_bytes(F, 1, batch)
    pairs = 3 + 4 + 5
    assert flops == 3 * (96 + 192) + 4 * 2 * 2 * pairs
    # weights: attention 96/2 params, MLP 3*4*8, BF16; KV read 2 prefix + 3 new tokens
    # of 2*1*2*2 = 8 bytes each.
    assert nbytes == (48 + 96) * 2 + 8 * (2 + 3)
    secs = RooflineCompute(TOY, DEV).layer_seconds([F, S, M], batch)
    assert secs[0] == pytest.approx(max(flops / 5e5, nbytes / 5e5) + 1e-3)


def test_roofline_swa_and_recurrent_by_hand() -> None:
    batch = [SeqWork(prefix=2, new=3)]
    rc = RooflineCompute(TOY, DEV)
    flops, nbytes = rc.layer_flops_bytes(S, 1, batch)
    assert flops == 3 * (96 + 192) + 16 * (2 + 2 + 2)  # window 2: every query sees 2
    assert nbytes == (48 + 96) * 2 + 8 * (2 + 3)       # prefix read capped at the window
    flops, nbytes = rc.layer_flops_bytes(M, 1, batch)
    # 2*4*10 + 2*4*4 + 100 = 212 per token; weights (40 + 16) * 2; one state read.
    assert flops == 3 * (212 + 192)
    assert nbytes == (40 + 16) * 2 + 96 * 2 + 64


def test_memory_floor_rules_small_batches() -> None:
    big = DeviceProfile("fast", 1e12, 1e3, 1.0, 1.0, 0.0, "test")
    (t,) = RooflineCompute(
        Architecture("f", "t", "F", 4, 2, 1, 2, 0, 8, None, None), big
    ).layer_seconds([F], [SeqWork(0, 1)])
    _, nbytes = RooflineCompute(
        Architecture("f", "t", "F", 4, 2, 1, 2, 0, 8, None, None), big
    ).layer_flops_bytes(F, 1, [SeqWork(0, 1)])
    assert t == pytest.approx(nbytes / 1e3)  # bandwidth bound, not compute bound


def test_moe_touches_the_expected_experts() -> None:
    arch = Architecture("moe", "t", "F", 4, 2, 1, 2, 0, 0, MoE(experts=4, active=1, inter=2), None)
    assert arch.mlp_flops() == 6 * 4 * 2 * 1 + 2 * 4 * 4
    one = arch.mlp_weight_bytes(1)  # one token: one expert of 3*4*2 params
    assert one == pytest.approx(3 * 4 * 2 * 2.0)
    many = arch.mlp_weight_bytes(10_000)  # all four experts
    assert many == pytest.approx(4 * 3 * 4 * 2 * 2.0)
    assert arch.mlp_weight_bytes(2) == pytest.approx(4 * (1 - 0.75**2) * 3 * 4 * 2 * 2.0)


def test_tensor_parallel_scales_both_peaks() -> None:
    four = DEV.with_gpus(4)
    assert four.flops == pytest.approx(DEV.flops * 4 * 0.8)
    assert four.bytes_per_s == pytest.approx(DEV.bytes_per_s * 4 * 0.8)
    with pytest.raises(ValueError, match="util"):
        DeviceProfile("bad", 1.0, 1.0, 1.5, 0.5, 0.0, "x")


def test_nemotron_mlp_layers_ride_on_the_cache_layer_before_them() -> None:
    arch = ARCHITECTURES["nemotron-h-8b"]
    mlps = arch.mlps_per_layer()
    assert len(mlps) == len(arch.layers) == 28 and sum(mlps) == 24
    assert arch.layers.count("F") == 4 and arch.layers.count("M") == 24
    assert arch.mlp_flops() == 4 * 4096 * 21504  # ReLU^2: two matrices


def test_fitted_profile_arithmetic_and_fit() -> None:
    fc = FittedCompute("t", {F: KindFit(1.0, 0.5, 0.25), S: KindFit(2.0, 0.0, 1.0),
                             M: KindFit(3.0, 1.0)}, window=2)
    batch = [SeqWork(0, 2), SeqWork(1, 1)]  # 3 tokens; FULL pairs 3 + 2; SWA pairs 3 + 2
    assert fc.layer_seconds([F, S, M], batch) == [1.0 + 1.5 + 1.25, 2.0 + 5.0, 3.0 + 3.0]
    samples = [(F, n, p, 0.1 + 0.01 * n + 0.001 * p) for n, p in
               [(1, 1), (2, 3), (4, 10), (8, 36), (3, 30)]]
    fit = FittedCompute.fit(samples)[F]
    assert (fit.base, fit.per_token, fit.per_pair) == pytest.approx((0.1, 0.01, 0.001))
    with pytest.raises(ValueError, match="at least 3 samples"):
        FittedCompute.fit(samples[:2])


def test_fit_never_goes_negative() -> None:
    # Time falls with tokens here: the per-token column is dropped, not negative.
    samples = [(M, n, 0, 1.0 - 0.001 * n) for n in (1, 10, 100, 200)]
    fit = FittedCompute.fit(samples)[M]
    assert fit.per_token == 0.0 and fit.base > 0


def test_published_cache_bytes_per_token() -> None:
    # KV per token per attention layer: 2 * kv_heads * head_dim * 2 bytes (BF16).
    assert ARCHITECTURES["qwen3-next-80b-a3b"].kv_bytes_per_token_layer == 2 * 2 * 256 * 2
    assert ARCHITECTURES["nemotron-h-8b"].kv_bytes_per_token_layer == 2 * 8 * 128 * 2
    assert ARCHITECTURES["gpt-oss-20b"].kv_bytes_per_token_layer == 2 * 8 * 64 * 2
    spec = simulated_spec("qwen3-next-80b-a3b", token_scale=1, page_size=16)
    assert spec.layer_bytes(F) == 16 * 2048
    assert spec.layer_bytes(M) == ARCHITECTURES["qwen3-next-80b-a3b"].recurrent.state_bytes  # type: ignore[union-attr]
    scaled = simulated_spec("nemotron-h-8b", token_scale=32, page_size=16)
    conv, ssm = scaled.mamba.tensors
    assert conv.shape == (320, 3) and conv.dtype == torch.bfloat16
    assert ssm.shape == (4, 64, 128) and ssm.dtype == torch.float32
    assert scaled.layer_bytes(M) * 32 == (
        ARCHITECTURES["nemotron-h-8b"].recurrent.state_bytes)  # type: ignore[union-attr]
    oss = simulated_spec("gpt-oss-20b", token_scale=32, page_size=4)
    assert oss.swa_window == 4 and oss.layers == "SF" * 12  # 128 real tokens
    with pytest.raises(ValueError, match="unknown architecture"):
        simulated_spec("llama", token_scale=1)


def test_device_profiles_are_published_figures() -> None:
    assert DEVICES["h100"].peak_flops == 989e12 and DEVICES["h200"].hbm_bytes_per_s == 4.8e12
    assert all(0 < d.util <= 1 and d.source for d in DEVICES.values())
    assert math.isclose(DEVICES["a100"].peak_flops, 312e12)


SCALES = [2**i for i in range(10)]  # every scale the replay accepts: 512 / block tokens


@pytest.mark.parametrize("name", sorted(ARCHITECTURES))
@pytest.mark.parametrize("k", SCALES)
def test_scaled_state_bytes_are_exactly_the_real_bytes_over_k(name: str, k: int) -> None:
    real = simulated_spec(name, token_scale=1)
    scaled = simulated_spec(name, token_scale=k)
    if "M" not in real.layers:  # gpt-oss: no recurrent layer, no state
        assert real_state_bytes(name) == 0
        return
    assert scaled.layer_bytes(M) * k == real.layer_bytes(M) == real_state_bytes(name)
    assert scaled.page_bytes(M) * k == real.page_bytes(M)
    assert real.state is not None and scaled.state is not None
    for r, s in zip(real.state.tensors, scaled.state.tensors, strict=True):
        assert s.numel * k == r.numel and s.dtype == r.dtype
        assert s.shape[-1] == r.shape[-1]  # trailing dims kept (merged at the front)


@pytest.mark.parametrize("name", ["qwen3-next-80b-a3b", "nemotron-h-8b"])
def test_a_scale_that_does_not_divide_a_state_is_refused(name: str) -> None:
    with pytest.raises(ValueError, match="does not divide"):
        simulated_spec(name, token_scale=3)


def test_weights_that_do_not_fit_are_refused() -> None:
    qwen = ARCHITECTURES["qwen3-next-80b-a3b"]
    with pytest.raises(ValueError, match=r"weights \(160 GB\) do not fit 1 x h100.*--gpus 3"):
        RooflineCompute(qwen, DEVICES["h100"])
    RooflineCompute(qwen, DEVICES["h100"].with_gpus(qwen.default_gpus))
    RooflineCompute(ARCHITECTURES["nemotron-h-8b"], DEVICES["h100"])
    small = DeviceProfile("small", 1e12, 1e12, 0.5, 0.5, 0.0, "t", hbm_capacity_bytes=16e9)
    with pytest.raises(ValueError, match="do not fit"):
        RooflineCompute(ARCHITECTURES["nemotron-h-8b"], small)


def test_utilisation_reproduces_its_anchor() -> None:
    """UTIL is the NIM anchor (docs/roofline.md): Llama-3.3-70B FP8 on
    2 x H100, 5000 tokens, TTFT 406.77 ms, against 2 x 1979 TFLOPS."""
    flops = 2 * 70.6e9 * 5000 + 4 * 80 * 8192 * attention_pairs(0, 5000)
    assert flops / 0.40677 / (2 * 1979e12) == pytest.approx(UTIL, abs=0.015)
    assert DEVICES["h100"].util == UTIL
