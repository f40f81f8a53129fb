"""`layerlift bench transfer-vllm` (issue 42) without vLLM: LayerLift's vLLM
worker (`BlockWorker`, which imports no vLLM) beside raw Mooncake rows, run
small on a real Mooncake master of its own; vLLM's own connector's rows are
left out here with a line saying why (they run in the vLLM suite,
``tests/hosts/vllm_host/test_transfer_vllm_msc.py``). A restore that is not
byte-exact ends the run: a figure is only printed for checked restores."""

from __future__ import annotations

import ctypes
import json
import os
from pathlib import Path

import pytest
import torch

from layerlift.bench import transfer_vllm
from layerlift.bench.results import render
from layerlift.hosts.vllm.worker_load import LoadSide
from layerlift.linker.load_in_place import InPlaceReads

pytestmark = [pytest.mark.mooncake]

SMALL = ["--tokens", "256", "--block-sizes", "16", "--repeats", "1", "--no-msc"]


def test_a_run_writes_every_row_with_its_ratios(tmp_path: Path,
                                                capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "transfer_vllm.json"
    assert transfer_vllm.main([*SMALL, "--json", str(out)]) == 0
    assert "MooncakeStoreConnector: not measured (--no-msc)" in capsys.readouterr().out
    record = json.loads(out.read_text())
    assert record["benchmark"] == "transfer-vllm"
    case = record["links"]["mooncake-tcp-loopback"]["256 tokens, block 16"]
    assert list(case["loads"]) == ["raw ranged d4", "raw ranged d4 + check",
                                   "LayerLift per layer", "LayerLift whole request"]
    assert list(case["offloads"]) == ["raw put", "LayerLift save", "LayerLift save call"]
    assert case["payload_bytes"] == 32 * 256 * 2 * 8 * 128 * 2
    for kind, raw in (("loads", "raw ranged d4"), ("offloads", "raw put")):
        for row, gbps in case[kind].items():
            assert 0 < gbps["min"] <= gbps["median"] <= gbps["max"], (kind, row)
        assert case[kind + " / raw"][raw] == {"min": 1.0, "median": 1.0, "max": 1.0}
        for row, busy in case[kind + " machine cores"].items():  # where a tick passed
            assert row in case[kind] and 0 < busy["median"] <= os.cpu_count(), (kind, row)
    # the save call ends before the last put does: never fewer GB/s than the save
    assert case["offloads"]["LayerLift save call"]["min"] >= case["offloads"]["LayerLift save"]["min"]
    assert case["LayerLift / MooncakeStoreConnector"] == {}
    table = render(record)
    assert "| mooncake-tcp-loopback | 256 tokens, block 16 | LayerLift per layer |" in table
    assert "| cores | machine |" in table
    # where the process's cores went, for every row whose rounds read them
    assert set(case["loads threads"]) <= set(case["loads"])
    for row, groups in case["loads threads"].items():
        assert set(groups) == {"store calls", "native", "main", "python", "ended"}, row


def test_a_restore_that_is_not_exact_ends_the_run(monkeypatch: pytest.MonkeyPatch,
                                                  tmp_path: Path) -> None:
    real = LoadSide._scatter

    def spoiled(self: LoadSide, seg, part, rows: torch.Tensor) -> None:  # type: ignore[no-untyped-def]
        real(self, seg, part, rows)
        if seg.local == 3:  # one layer's first block: one byte flipped after its copy
            g, blocks = part.target
            kv = self.kv[self._groups[g].layer_names[seg.local]]
            kv[blocks[seg.lo]].view(torch.uint8).view(-1)[0] ^= 0xFF

    monkeypatch.setattr(LoadSide, "_scatter", spoiled)
    with pytest.raises(RuntimeError, match="a restore wrote wrong bytes"):
        transfer_vllm.main([*SMALL, "--json", str(tmp_path / "x.json")])
    assert not (tmp_path / "x.json").exists()


REAL_BLOCK = ["--tokens", "256", "--block-sizes", "128", "--repeats", "1", "--no-msc"]


def test_with_staged_measures_both_restores_in_the_same_rounds(tmp_path: Path) -> None:
    """At 128-token blocks (512 KiB a layer) the worker restores in place;
    ``--with-staged`` adds a worker that restores through staging, its rows
    and the paired ratios of the two, every restore checked."""
    out = tmp_path / "ab.json"
    assert transfer_vllm.main([*REAL_BLOCK, "--with-staged", "--json", str(out)]) == 0
    case = json.loads(out.read_text())["links"]["mooncake-tcp-loopback"]["256 tokens, block 128"]
    assert list(case["loads"])[-2:] == ["LayerLift per layer, staged",
                                        "LayerLift whole request, staged"]
    ab = case["default / staged restores"]
    assert set(ab) == {"LayerLift per layer", "LayerLift whole request"}
    assert all(0 < r["min"] <= r["median"] <= r["max"] for r in ab.values())


def test_an_in_place_restore_spoiled_after_its_check_ends_the_run(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """The negative control of the in-place path: one byte of one layer's
    first block flipped after its slices verified where they landed is
    caught by the benchmark's own comparison with the source."""
    real = InPlaceReads._verify_in_place

    def spoiled(self: InPlaceReads, layer: int, plan, region) -> None:  # type: ignore[no-untyped-def]
        real(self, layer, plan, region)
        if layer == 3:
            first = plan[0][1][0]  # the first row's address of the first segment
            ctypes.c_uint8.from_address(first).value ^= 0xFF

    monkeypatch.setattr(InPlaceReads, "_verify_in_place", spoiled)
    with pytest.raises(RuntimeError, match="a restore wrote wrong bytes"):
        transfer_vllm.main([*REAL_BLOCK, "--json", str(tmp_path / "x.json")])
    assert not (tmp_path / "x.json").exists()
