"""`layerlift bench transfer-sglang` (issue 42): SGLang's two linkers as rows of
the transfer benchmark, run small on real Mooncake masters of its own.

A run writes every row (raw ranged reads and puts, each linker's load and
offload) with its ratios, counts what a restore landed, and ends with an
error when a linker's restore is not byte-exact: a figure is only printed for
restores that were checked. Two small runs (512 tokens, one round after the
warm-up), ~40 s together on the 2-core box.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

from layerlift.bench import transfer_sglang
from layerlift.bench.results import render
from layerlift.testing.sglang_harness import SGLangHost

pytestmark = [pytest.mark.sglang, pytest.mark.mooncake, pytest.mark.slow]

SMALL = ["--tokens", "512", "--page-sizes", "64", "--repeats", "1"]
TOKEN_LAYER_BYTES = 2 * 8 * 128 * 2  # K+V, 8 heads x 128, bf16


def test_a_run_writes_every_row_with_its_ratios(tmp_path: Path) -> None:
    out = tmp_path / "transfer_sglang.json"
    assert transfer_sglang.main([*SMALL, "--json", str(out)]) == 0
    record = json.loads(out.read_text())
    assert record["benchmark"] == "transfer-sglang"
    case = record["links"]["mooncake-tcp-loopback"]["512 tokens, page 64"]
    linkers = ["LayerLiftLinker", "MooncakeDirectLinker"]
    assert list(case["loads"]) == ["raw ranged d4", "raw ranged d4 + check", *linkers]
    assert list(case["offloads"]) == ["raw put", *linkers]
    for kind in ("loads", "offloads"):
        for row, gbps in case[kind].items():
            assert 0 < gbps["min"] <= gbps["median"] <= gbps["max"], (kind, row)
            assert case[kind + " cores"][row]["median"] > 0
        # the machine's cores where every round read a tick (a short step may not)
        for row, busy in case[kind + " machine cores"].items():
            assert row in case[kind] and 0 < busy["median"] <= os.cpu_count(), (kind, row)
        raw = "raw ranged d4" if kind == "loads" else "raw put"
        assert case[kind + " / raw"][raw] == {"min": 1.0, "median": 1.0, "max": 1.0}
    # What a restore landed: 30 full-attention layers of the prompt, the
    # sliding-window layer's last 128-token window, the Mamba state.
    full = 30 * 512 * TOKEN_LAYER_BYTES + 128 * TOKEN_LAYER_BYTES
    assert full < case["load_bytes"] < full + (16 << 20)
    assert case["offload_bytes"] == 31 * 512 * TOKEN_LAYER_BYTES
    assert case["raw_bytes"] == 32 * 512 * TOKEN_LAYER_BYTES
    ratio = case["LayerLift / MooncakeDirectLinker"]
    assert ratio["load"]["median"] > 0 and ratio["offload"]["median"] > 0
    table = render(record)
    assert "| mooncake-tcp-loopback | 512 tokens, page 64 | LayerLiftLinker |" in table
    assert table.count("MooncakeDirectLinker |") >= 2
    assert "| cores | machine |" in table


def test_a_restore_that_is_not_exact_ends_the_run(monkeypatch: pytest.MonkeyPatch,
                                                  tmp_path: Path) -> None:
    real = SGLangHost.loaded_layer

    def one_flipped_byte(self: SGLangHost, tail: torch.Tensor, slot: int,
                         layer: int) -> list[torch.Tensor]:
        got = real(self, tail, slot, layer)
        if layer == 5:
            got[0].view(torch.uint8).view(-1)[123] ^= 0x10
        return got

    monkeypatch.setattr(SGLangHost, "loaded_layer", one_flipped_byte)
    out = tmp_path / "never.json"
    with pytest.raises(RuntimeError, match="loaded wrong bytes into layer 5"):
        transfer_sglang.main([*SMALL, "--json", str(out)])
    assert not out.exists()


def test_a_linker_whose_offloads_never_end_is_reported_not_measured(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    # As SGLang's linker did over a 10 Gbit namespace link: its offloads of a
    # prompt still pending after the bound. The run goes on with the others.
    real = SGLangHost.settle_offloads

    def stalls_for_sglangs_linker(self: SGLangHost, timeout_s: float = 30.0) -> int:
        if type(self.linker).__name__ == "MooncakeDirectLinker":
            raise RuntimeError("2 offload(s) still pending")
        return real(self, timeout_s)

    monkeypatch.setattr(SGLangHost, "settle_offloads", stalls_for_sglangs_linker)
    out = tmp_path / "stalled.json"
    assert transfer_sglang.main([*SMALL, "--json", str(out)]) == 0
    case = json.loads(out.read_text())["links"]["mooncake-tcp-loopback"]["512 tokens, page 64"]
    assert list(case["loads"]) == ["raw ranged d4", "raw ranged d4 + check", "LayerLiftLinker"]
    assert list(case["offloads"]) == ["raw put", "LayerLiftLinker"]
    assert "did not end within" in case["not measured"]["MooncakeDirectLinker"]
    assert "LayerLift / MooncakeDirectLinker" not in case
    table = render(json.loads(out.read_text()))
    assert "| MooncakeDirectLinker | not measured: MooncakeDirectLinker's offloads" in table
