"""`bench/machine_cpu.py`: the machine's busy cores from `/proc/stat`."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from layerlift.bench import machine_cpu
from layerlift.bench.machine_cpu import CpuSample, cores

STAT = """cpu  {user} 0 {system} {idle} {iowait} 0 {softirq} {steal} 0 0
cpu0 1 0 1 1 0 0 0 0 0 0
cpu1 1 0 1 1 0 0 0 0 0 0
intr 12345
"""


def fake_stat(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, **fields: int) -> None:
    path = tmp_path / "stat"
    path.write_text(STAT.format(**fields))
    monkeypatch.setattr(machine_cpu, "_STAT", path)


def test_busy_is_every_state_but_idle_iowait_and_steal(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    fake_stat(tmp_path, monkeypatch, user=100, system=50, idle=300, iowait=20, softirq=30,
              steal=10)
    s = machine_cpu.sample()
    assert s == CpuSample(busy=180, total=510, cpus=2)


def test_cores_over_a_stretch(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    fake_stat(tmp_path, monkeypatch, user=100, system=0, idle=100, iowait=0, softirq=0,
              steal=0)
    before = machine_cpu.sample()
    # 200 jiffies later: 150 busy (user and softirq), 50 idle, over two CPUs
    fake_stat(tmp_path, monkeypatch, user=220, system=0, idle=150, iowait=0, softirq=30,
              steal=0)
    assert cores(before, machine_cpu.sample()) == pytest.approx(150 / 200 * 2)
    assert cores(before, before) is None  # no tick between them
    assert cores(None, before) is None and cores(before, None) is None


def test_no_proc_stat_is_none(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(machine_cpu, "_STAT", tmp_path / "missing")
    assert machine_cpu.sample() is None
    (tmp_path / "odd").write_text("not a stat file\n")
    monkeypatch.setattr(machine_cpu, "_STAT", tmp_path / "odd")
    assert machine_cpu.sample() is None


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc/stat is Linux's")
def test_this_machine() -> None:
    s = machine_cpu.sample()
    assert s is not None and 0 <= s.busy <= s.total and s.cpus >= 1


def test_busy_adds_stretches_and_skips_missing_samples() -> None:
    busy = machine_cpu.Busy()
    assert busy.cores is None  # nothing added yet
    busy.add(CpuSample(0, 0, 2), CpuSample(50, 100, 2))  # 1.0 core over 100 ticks
    busy.add(None, CpuSample(500, 600, 2))  # a missing sample adds nothing
    busy.add(CpuSample(100, 200, 2), CpuSample(190, 300, 2))  # 1.8 cores over 100 ticks
    assert busy.cores == pytest.approx((50 + 90) / 200 * 2)
