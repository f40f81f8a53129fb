"""``bench/device_adapters.py`` runs end to end on the simulated device (``--quick``):
every figure it reports is there and positive, and every forward read the stored bytes."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from layerlift.bench.device_adapters import Config, main


def test_the_device_benchmark_runs_on_the_simulated_device(tmp_path: Path) -> None:
    out = tmp_path / "device.json"
    table = tmp_path / "device.md"
    assert main(["--device", "sim", "--quick", "--json", str(out),
                 "--markdown", str(table)]) == 0
    result = json.loads(out.read_text())
    assert result["exact"] is True and result["runs"] == 2
    assert len(result["h2d_gbps"]) == 4 and min(result["h2d_gbps"]) > 0
    assert len(result["wait_ms"]) == 4 and min(result["wait_ms"]) >= 0
    assert result["overlap_ms"] > 0 and result["whole_ms"] > 0 and result["compute_ms"] > 0
    assert "forward's wait per layer" in table.read_text()


def test_the_device_benchmark_refuses_bad_settings() -> None:
    with pytest.raises(ValueError, match="whole number"):
        Config(device="sim", tokens=65, page=16)
    with pytest.raises(ValueError, match="cuda or sim"):
        Config(device="tpu")
