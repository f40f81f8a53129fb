"""``layerlift bench vllm``'s per-layer overlap: the worker's per-layer record
(``LayerLift: per-layer restore of REQ: {json}``) parsed into the hidden
fraction and the share of layers ready before the forward reached them, and
both rendered with intervals beside the load-time measure; the compute
stand-in and the namespace link, checked before anything starts."""

from __future__ import annotations

import json
from typing import Any

import pytest

from layerlift.bench.vllm_bench import (
    PAGE,
    _median_ci,
    hidden_fractions,
    layer_overlaps,
    layout_for,
    main,
    render,
    stored_bytes,
)
from layerlift.testing.vllm_verify import kv_transfer_config


def _line(req: str, ready: list[float], reached: list[float | None], waited: list[float],
          prefix: str = "(EngineCore_DP0 pid=7) INFO 12-02 03:00:00 [worker.py:331] ") -> str:
    record = {"layers": [f"model.layers.{i}.self_attn.attn" for i in range(len(ready))],
              "device": "host", "ready_ms": ready, "reached_ms": reached, "waited_ms": waited}
    return f"{prefix}LayerLift: per-layer restore of {req}: " \
           f"{json.dumps(record, separators=(',', ':'))}\n"


def test_per_layer_hidden_and_ready_first_from_the_records() -> None:
    log = (_line("0-ab", [10.0, 20.0, 40.0], [5.0, 25.0, 30.0], [5.0, 0.0, 10.0])
           + "LayerLift: restored 0-ab (4 objects, verified)\n"
           + _line("1-cd", [2.0, 4.0], [3.0, 4.0], [0.0, 0.0], prefix="")
           + _line("2-ef", [8.0, 9.0], [None, 1.0], [0.0, 8.0], prefix=""))
    got = layer_overlaps(log)
    assert [r["req"] for r in got] == ["0-ab", "1-cd", "2-ef"]
    # 0-ab: the span ends at the last layer's ready (40 ms), the forward
    # waited 15 ms of it; layer 1 was ready (20) before reached (25), layers
    # 0 (10 > 5) and 2 (40 > 30) were not.
    assert got[0]["span_ms"] == 40.0 and got[0]["waited_ms"] == 15.0
    assert got[0]["hidden"] == pytest.approx(1 - 15 / 40)
    assert got[0]["ready_first"] == pytest.approx(1 / 3)
    assert got[0]["layers"] == 3 and got[0]["device"] == "host"
    # 1-cd: never waited, every layer ready when reached (4 <= 4 counts).
    assert got[1]["hidden"] == 1.0 and got[1]["ready_first"] == 1.0
    # 2-ef: a layer never reached is left out of ready_first; waits beyond
    # the span clamp to 0.
    assert got[2]["ready_first"] == 0.0
    assert got[2]["hidden"] == pytest.approx(1 - 8 / 9)
    assert layer_overlaps(_line("3-gh", [1.0], [0.5], [20.0]))[0]["hidden"] == 0.0


def test_the_per_layer_record_is_not_the_summary_line() -> None:
    """The load-time measure (the summary line) stays as it was; the per-layer
    parser reads only the per-layer records."""
    summary = "LayerLift: synchronous restore of 0-ab: load 40.0 ms, the forward waited 10.0 ms\n"
    assert layer_overlaps(summary) == []
    assert hidden_fractions(summary + _line("0-ab", [1.0], [1.0], [0.0])) == [
        pytest.approx(0.75)]


@pytest.mark.parametrize("bad", [
    "LayerLift: per-layer restore of r: {\"layers\": [\"a\"], \"ready_ms\": [1.0]\n",  # cut off
    _line("r", [1.0, 2.0], [1.0], [0.0, 0.0]),  # a list shorter than the layers
    _line("r", [1.0, -2.0], [1.0, 2.0], [0.0, 0.0]),  # a negative time
    'LayerLift: per-layer restore of r: {"layers":["a"],"ready_ms":[null],'
    '"reached_ms":[1],"waited_ms":[0]}\n',  # a layer never ready
    'LayerLift: per-layer restore of r: {"layers":[],"ready_ms":[],"reached_ms":[],'
    '"waited_ms":[]}\n',  # no layers
])
def test_a_malformed_record_is_a_value_error(bad: str) -> None:
    with pytest.raises(ValueError, match="per-layer record of r"):
        layer_overlaps(bad)


def _row(connector: str, per_layer: list[dict[str, Any]]) -> dict[str, Any]:
    return {"connector": connector, "ttft_s": [[0.03]], "median_s": 0.03, "ci95_s": [0.02, 0.04],
            "hidden": [0.5, 0.7], "hidden_median_ci95": [0.6, 0.5, 0.7], "per_layer": per_layer,
            "layer_hidden_median_ci95": _median_ci([r["hidden"] for r in per_layer]),
            "ready_first_median_ci95": _median_ci([r["ready_first"] for r in per_layer]),
            "cached_tokens": [[1024]], "tokens": [5], "same_first_tokens": True,
            "warm_s": [0.05]}


def test_render_labels_both_measures_with_intervals() -> None:
    many = layer_overlaps(_line("a", [10.0, 20.0], [5.0, 25.0], [5.0, 0.0])
                          + _line("b", [10.0, 20.0], [15.0, 25.0], [0.0, 0.0])
                          + _line("c", [10.0, 40.0], [5.0, 25.0], [5.0, 15.0]))
    record = {"model": "llama", "hidden": 512, "layers": 8, "prompt_tokens": 1074,
              "prefix_tokens": 1024, "prompts": 3, "repeats": 1, "load_avg": [0.5],
              "rows": [_row("layerlift-sync", many), _row("layerlift-sync", many[:1]),
                       _row("none", [])], "meta": {"command": "layerlift bench vllm"}}
    text = render(record)
    assert "hidden, load time (median, 95%)" in text
    assert "hidden, per layer (median, 95%, restores)" in text
    rows = [line for line in text.splitlines() if line.startswith("| layerlift-sync")]
    # per-layer hidden of a, b, c: 0.75, 1.0, 0.5 -> median 75%, with its
    # interval and 3 restores; ready first: 0.5, 1.0, 0.5 -> 50%.
    cells = [c.strip() for c in rows[0].split("|")]
    assert cells[6] == "60% (50%-70%)"  # the load-time measure, unchanged
    assert cells[7].startswith("75% (") and cells[7].endswith(", 3)")
    assert cells[8].startswith("50% (")
    assert "1 restore, no interval" in rows[1]
    none = [c.strip() for c in next(line for line in text.splitlines()
                                     if line.startswith("| none")).split("|")]
    assert none[7] == "-" and none[8] == "-"


def test_a_record_without_per_layer_data_renders_as_before() -> None:
    row = _row("layerlift-sync", [])
    for key in ("per_layer", "layer_hidden_median_ci95", "ready_first_median_ci95"):
        del row[key]
    record = {"model": "llama", "prompt_tokens": 1074, "prefix_tokens": 1024, "prompts": 1,
              "repeats": 1, "load_avg": [0.5], "rows": [row], "meta": {"command": "c"}}
    text = render(record)
    assert "load hidden by the forward (median, 95%)" in text and "per layer" not in text
    assert "| layerlift-sync | 30 | 20-40 | 1024 | True | 60% (50%-70%) | 50 |" in text


def test_render_names_the_link_and_the_compute_stand_in() -> None:
    row = _row("layerlift-sync", [])
    base = {"model": "llama", "prompt_tokens": 1074, "prefix_tokens": 1024, "prompts": 1,
            "repeats": 1, "load_avg": [0.5], "rows": [row], "meta": {"command": "c"}}
    first = render(base).splitlines()[0]
    assert "link" not in first and "stand-in" not in first  # loopback, none: as before
    first = render({**base, "link": "netns:10gbit", "compute_ms": 9.285}).splitlines()[0]
    assert "; link netns:10gbit" in first
    assert "compute stand-in 9.285 ms a layer after each layer's wait, every connector" in first


def _main_error(argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2  # argparse's usage error: nothing started
    return capsys.readouterr().err


def test_the_stand_in_and_the_link_are_checked_before_anything_starts(
        capsys: pytest.CaptureFixture[str]) -> None:
    err = _main_error(["--connectors", "none,layerlift", "--compute-ms", "5"], capsys)
    assert "'none' has no connector" in err
    # the real layout's default stand-in is a compute, so 'none' needs --compute-ms 0
    err = _main_error(["--layout", "real", "--connectors", "none,layerlift"], capsys)
    assert "'none' has no connector" in err
    assert "must be >= 0" in _main_error(["--compute-ms", "-1"], capsys)
    assert "netns:RATE" in _main_error(["--link", "wan"], capsys)
    err = _main_error(["--link", "netns:10gbit", "--cluster", "10.0.0.1:50051"], capsys)
    assert "engine host's own option" in err


def test_the_stand_in_names_the_connectors_stand_in_class() -> None:
    assert kv_transfer_config("layerlift", {}, standin=True) == {
        "kv_connector": "StandInLayerLiftConnector",
        "kv_connector_module_path": "layerlift.testing.vllm_standin", "kv_role": "kv_both",
        "kv_load_failure_policy": "recompute", "kv_connector_extra_config": {}}
    msc = kv_transfer_config("mooncake", {"a": 1}, standin=True)
    assert msc is not None and msc["kv_connector"] == "StandInMooncakeStoreConnector"
    assert msc["kv_connector_module_path"] == "layerlift.testing.vllm_standin"
    plain = kv_transfer_config("mooncake", {})
    assert plain is not None and "kv_connector_module_path" not in plain  # vLLM's own registry
    assert kv_transfer_config("layerlift", {})["kv_connector"] == "LayerLiftConnector"  # type: ignore[index]
    assert kv_transfer_config("none", {}) is None
    with pytest.raises(ValueError, match="no connector has none"):
        kv_transfer_config("none", {}, standin=True)
    with pytest.raises(ValueError, match="unknown connector"):
        kv_transfer_config("lmcache", {})


def test_the_segment_holds_every_connectors_objects() -> None:
    real = layout_for("real", 64 * PAGE + 50)
    one = 64 * PAGE * real.token_bytes(32)  # one prompt's objects, 1 GiB
    assert stored_bytes(["none"], 1, 64, real, 32) == 512 << 20  # the floor
    assert stored_bytes(["none", "mooncake", "layerlift"], 1, 64, real, 32) == (
        2 * one * 5 // 4 + (256 << 20))
