"""The `layerlift` console script: `master --help` and a tiny `bench ttft` grid."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from layerlift.cli import main

POINT_KEYS = {
    "link", "prefix_tokens", "suffix_tokens", "batch", "preset", "ttft_s", "ttft_p90_s",
    "load_s", "compute_s", "bound_s", "efficiency", "speedup", "forward_start_s",
    "restored_tokens", "computed_tokens", "max_kl", "kl_ok",
}
STRATS = {"recompute", "barrier", "overlap"}


def test_master_help(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["master", "--help"])
    assert exc.value.code == 0
    assert "--rpc-port" in capsys.readouterr().out


def test_top_level_usage(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--help"]) == 0
    assert "bench ttft" in capsys.readouterr().out
    assert main(["nonsense"]) == 2


def test_bench_ttft_tiny_grid(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out_json, out_md = tmp_path / "t.json", tmp_path / "t.md"
    rc = main(["bench", "ttft", "--preset", "tiny", "--prefix", "64,128", "--suffix", "16",
               "--batch", "1,2", "--repeats", "1", "--warmup", "0", "--links", "emulated:1,10",
               "--no-progress", "--json", str(out_json), "--markdown", str(out_md)])
    assert rc == 0
    table = capsys.readouterr().out
    assert "emulated:1GB/s,10us" in table and "share" in table
    data = json.loads(out_json.read_text())
    points = data["points"]
    assert len(points) == 4
    for p in points:
        assert set(p) >= POINT_KEYS
        assert set(p["ttft_s"]) == STRATS and set(p["ttft_p90_s"]) == STRATS
        assert set(p["forward_start_s"]) == {"barrier", "overlap"}
        assert p["link"] == "emulated:1GB/s,10us" and p["preset"] == "tiny"
        assert p["restored_tokens"] == p["prefix_tokens"]
        assert p["computed_tokens"] == p["suffix_tokens"] == 16
        assert p["kl_ok"] and p["max_kl"] <= 1e-9
        assert all(v > 0 for v in p["ttft_s"].values())
        assert p["load_s"] > 0 and p["compute_s"] > 0 and p["bound_s"] > 0
    assert {(p["prefix_tokens"], p["batch"]) for p in points} == {
        (64, 1), (128, 1), (64, 2), (128, 2)}
    assert out_md.read_text().startswith("# LayerLift TTFT benchmark")


def test_bench_rejects_bad_prefix(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["bench", "ttft", "--preset", "tiny", "--prefix", "50", "--links", "emulated:1"])
    assert exc.value.code == 2
    assert "checkpoint interval" in capsys.readouterr().err


def test_console_script_master_help() -> None:
    proc = subprocess.run([sys.executable, "-c", "from layerlift.cli import main; "
                           "raise SystemExit(main(['master', '--help']))"],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0 and "layerlift master" in proc.stdout
