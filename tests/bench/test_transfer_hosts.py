"""What the host transfer benchmarks share (`bench/transfer_hosts.py`) and
their clock (`transfer.Clock`): a unit's `Step` carries the machine's busy
cores beside the process's, the record keeps a row's machine figure only
where every round read one, and the hosts' table shows it (`-` in a record
from before it was kept)."""

from __future__ import annotations

import pytest

from layerlift.bench import machine_cpu
from layerlift.bench.machine_cpu import CpuSample
from layerlift.bench.transfer import Clock, Step
from layerlift.bench.transfer_hosts import NotMeasured, Rounds
from layerlift.bench.transfer_report import host_rows_table


def test_a_clock_reads_the_machine_from_its_start(monkeypatch: pytest.MonkeyPatch) -> None:
    samples = iter([CpuSample(busy=100, total=400, cpus=2), CpuSample(busy=250, total=600, cpus=2)])
    monkeypatch.setattr(machine_cpu, "sample", lambda: next(samples))
    clock = Clock()
    lap = clock.lap()  # the second sample: 150 busy of 200 jiffies over 2 CPUs
    step = lap(10**9)
    assert isinstance(step, Step) and step.gbps > 0 and step.cores >= 0
    assert step.machine == pytest.approx(1.5)


def test_a_clock_from_given_readings_uses_the_given_sample(monkeypatch: pytest.MonkeyPatch,
                                                           ) -> None:
    """The SGLang harness starts a Clock at its insert: the readings and the
    sample are that moment's, not the benchmark's later one."""
    monkeypatch.setattr(machine_cpu, "sample", lambda: CpuSample(busy=300, total=500, cpus=2))
    given = Clock(wall=0.0, cpu=0.0, machine=CpuSample(busy=100, total=300, cpus=2))
    assert given.machine == CpuSample(busy=100, total=300, cpus=2)
    assert given.stop(1).machine == pytest.approx(2.0)  # 200 busy of 200
    assert Clock(wall=0.0, cpu=0.0).stop(1).machine is None  # no sample given: not made up
    monkeypatch.setattr(machine_cpu, "sample", lambda: None)  # no /proc/stat
    assert Clock().stop(1).machine is None


def steps(*machine: float | None) -> list[Step]:
    return [Step(1.0 + i, 0.5, m) for i, m in enumerate(machine)]


def test_rounds_keep_a_machine_figure_only_from_every_round() -> None:
    a = iter(steps(1.0, 1.2, 1.4))  # the warm-up round first
    b = iter(steps(1.9, None, 1.8))
    raw = iter([Step(1.0, 0.5, 1.0)] * 3)
    units = {"raw": lambda: {"raw": next(raw)},
             "ours": lambda: {"a": next(a), "b": next(b)}}
    rounds = Rounds(units, repeats=2)
    assert len(rounds.runs) == 2
    got = rounds.spreads("loads", {"A": "a", "B": "b", "raw": "raw"}, "raw")
    assert set(got) == {"loads", "loads / raw", "loads cores", "loads machine cores",
                        "loads threads"}
    assert got["loads threads"] == {}  # no round read its threads: none made up
    assert got["loads machine cores"]["A"]["median"] == pytest.approx(1.3)
    assert "B" not in got["loads machine cores"]  # one round read none
    assert got["loads"]["A"]["median"] == pytest.approx(2.5)  # GB/s 2 and 3
    assert got["loads / raw"]["A"]["median"] == pytest.approx(2.5)
    assert got["loads cores"]["B"]["median"] == pytest.approx(0.5)


def test_rounds_keep_thread_figures_only_from_every_round() -> None:
    def split(store: float) -> dict[str, float]:
        return {"store calls": store, "native": 0.5, "main": 0.0, "python": 0.25, "ended": 0.0}

    a = iter([Step(1.0, 1.0, None, split(s)) for s in (0.1, 0.2, 0.4)])
    b = iter([Step(1.0, 1.0, None, t) for t in (split(0.1), None, split(0.3))])
    rounds = Rounds({"u": lambda: {"a": next(a), "b": next(b)}}, repeats=2)
    got = rounds.spreads("loads", {"A": "a", "B": "b"}, "a")["loads threads"]
    assert set(got) == {"A"}  # B's first timed round read none
    assert got["A"]["store calls"]["median"] == pytest.approx(0.3)
    assert got["A"]["python"]["median"] == pytest.approx(0.25)


def test_a_unit_not_measured_leaves_every_round() -> None:
    calls = {"n": 0}

    def flaky() -> dict[str, Step]:
        calls["n"] += 1
        raise NotMeasured("the host's offloads never ended")

    rounds = Rounds({"raw": lambda: {"raw": Step(1.0, 0.1, None)}, "host": flaky}, repeats=3)
    assert calls["n"] == 1 and "host" in rounds.failed
    assert all(set(r) == {"raw"} for r in rounds.runs)


def record(machine: bool) -> dict[str, object]:
    g = {"min": 1.0, "median": 1.0, "max": 1.0}
    case: dict[str, object] = {"loads": {"raw": g}, "loads / raw": {"raw": g},
                               "loads cores": {"raw": g}, "offloads": {}, "offloads / raw": {},
                               "offloads cores": {}}
    if machine:
        case["loads machine cores"] = {"raw": {"min": 1.5, "median": 1.75, "max": 2.0}}
    return {"links": {"loopback": {"case": case}}, "layout": "L", "timing": "T"}


@pytest.mark.parametrize("threads", [True, False])
def test_the_hosts_table_shows_where_the_cores_go(threads: bool) -> None:
    rec = record(True)
    if threads:
        g = {"min": 0.1, "median": 0.25, "max": 0.5}
        rec["links"]["loopback"]["case"]["loads threads"] = {  # type: ignore[index]
            "raw": {"store calls": g, "native": g, "main": g, "python": g}}  # no "ended": older
    table = host_rows_table(rec, host="Host", paired=lambda c, k, r: None,
                            not_measured_in=lambda kind, row: True)
    head = "| link | case | kind | row | store calls | native | main | python | ended |"
    assert (head in table) == threads
    if threads:
        row = next(line for line in table.splitlines()
                   if line.startswith("| loopback | case | loads | raw |"))
        assert row.endswith("| 0.25 | 0.25 | 0.25 | 0.25 | - |")


@pytest.mark.parametrize("machine", [True, False])
def test_the_hosts_table_shows_the_machine_column(machine: bool) -> None:
    table = host_rows_table(record(machine), host="Host", paired=lambda c, k, r: None,
                            not_measured_in=lambda kind, row: True)
    assert "| link | case | row | GB/s | / raw | / Host | cores | machine |" in table
    row = next(line for line in table.splitlines() if line.startswith("| loopback | case | raw"))
    assert row.endswith("| 1.00 | 1.75 |" if machine else "| 1.00 | - |")

