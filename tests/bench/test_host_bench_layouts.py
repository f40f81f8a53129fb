"""The host benchmarks' real layout (issue 42, item 3): the shapes, sizes and
compute stand-in `bench sglang --layout real` and `bench vllm --layout real`
run with, checked without either host installed."""

from __future__ import annotations

import pytest

from layerlift.bench.sglang_bench import build_parser
from layerlift.bench.sglang_setup import (
    LINKERS,
    SEGMENT_CAP_MIB,
    kv_bytes,
    prefill_ms_per_layer,
    segment_mib,
    shape_for,
)
from layerlift.bench.vllm_bench import PAGE, Layout, layout_for


def test_sglangs_real_layout_is_32_layers_of_8_kv_heads_of_128() -> None:
    shape = shape_for(64, "real", 8192)
    assert len(shape.kinds) == 32 and set(shape.kinds) == {"F", "S", "M"}
    assert (shape.head_num, shape.head_dim, shape.page_size) == (8, 128, 64)
    assert shape.kv_tokens >= 8192 + 64  # the prompt and the request's extra token
    assert kv_bytes(shape, 1) == 2 * 8 * 128 * 2 * 31  # 31 attention layers, bf16
    assert kv_bytes(shape, 8192) > 900 << 20  # ~1 GiB a prompt
    # A producer's segment holds two prompts where it can, and stays under 2 GiB.
    assert segment_mib(shape, 8192) == SEGMENT_CAP_MIB
    assert segment_mib(shape_for(64), 1024) == 256
    assert shape_for(64).kinds == "FSMSMF" * 2  # the small layout is unchanged


def test_the_real_layouts_compute_stand_in_is_a_llama_layers_roofline() -> None:
    # Per layer: 2 * (attention projections + SwiGLU MLP) FLOPs a token plus
    # causal attention, at 45 % of an H100's 989 TFLOPS.
    at_8k = prefill_ms_per_layer(8192)
    assert 8.5 < at_8k < 10.0
    assert prefill_ms_per_layer(1024) < at_8k / 7  # the projections are linear in tokens
    assert prefill_ms_per_layer(32768) > 4 * at_8k  # attention is not


def test_sglang_benchs_layout_option_is_checked() -> None:
    args = build_parser().parse_args(["--layout", "real", "--no-faults"])
    assert (args.layout, args.prompt_tokens, args.compute_ms) == ("real", None, None)
    with pytest.raises(SystemExit):
        build_parser().parse_args(["--layout", "huge"])
    assert LINKERS[0] == "layerlift"  # the paired ratio is LINKERS[0] over LINKERS[1]


def test_vllms_real_layout_sizes_the_cache_for_one_request() -> None:
    small = Layout()
    assert small.kv_cache_bytes(8) is None and small.token_bytes(1) == 2 * 64 * 4
    real = layout_for("real", 64 * PAGE + 50)
    assert (real.kv_heads, real.head_dim, real.dtype) == (8, 128, "bfloat16")
    assert real.token_bytes(32) == 128 << 10  # a real model's 128 KiB a token
    assert real.max_model_len >= 64 * PAGE + 50 and real.max_model_len % PAGE == 0
    cache = real.kv_cache_bytes(32)
    assert cache is not None and cache >= real.max_model_len * real.token_bytes(32)
    assert layout_for("real", 100).max_model_len == 4096  # never below the small default


def test_vllm_bench_pairs_each_connector_with_mooncake_round_by_round() -> None:
    from layerlift.bench.vllm_bench import _pooled, paired_to

    assert _pooled([[1.0], [2.0], [3.0]]) == [[1.0, 2.0, 3.0]]  # one prompt: rounds pooled
    assert _pooled([[1.0, 2.0], [3.0, 4.0]]) == [[1.0, 2.0], [3.0, 4.0]]
    rows = [{"connector": "mooncake", "ttft_s": [[2.0], [4.0], [1.0]]},
            {"connector": "layerlift", "ttft_s": [[1.0], [2.0], [2.0]]}]
    paired_to(rows, "mooncake")
    assert "ratio_to" not in rows[0]
    ratio = rows[1]["ratio_to"]
    assert ratio["connector"] == "mooncake" and ratio["median"] == 0.5  # 0.5, 0.5, 2.0
    assert ratio["lo"] <= 0.5 <= ratio["hi"] and ratio["hi"] <= 2.0
    lonely = [{"connector": "layerlift", "ttft_s": [[1.0]]}]
    paired_to(lonely, "mooncake")  # no mooncake row: nothing to pair with
    assert "ratio_to" not in lonely[0]


def test_vllm_bench_lets_every_instance_go_idle_before_its_turn(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """vLLM's queue readers busy-poll for 1 s after their last message: each
    instance's timed turn starts only after QUIET_S of nobody's generate."""
    from layerlift.bench import vllm_bench

    events: list[str] = []

    class Fake:
        def __init__(self, name: str) -> None:
            self.name = name

        def generate(self, prompts: list[list[int]]) -> list[dict[str, float]]:
            events.append(self.name)
            return [{"wall_s": 0.0} for _ in prompts]

    monkeypatch.setattr(vllm_bench.time, "sleep", lambda s: events.append(f"sleep {s}"))
    instances = {"a": Fake("a"), "b": Fake("b")}
    rounds, warm = vllm_bench._interleaved(instances, [[1]], [[1], [2]], repeats=2)
    assert vllm_bench.QUIET_S > 1.0
    quiet = f"sleep {vllm_bench.QUIET_S}"
    assert events == ["a", "b"] + [quiet, "a", quiet, "b"] * 2
    assert [len(r) for r in rounds["a"]] == [2, 2] and set(warm) == {"a", "b"}
