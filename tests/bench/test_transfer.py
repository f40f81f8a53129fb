"""The transfer benchmark (`layerlift bench transfer`) on a real Mooncake
master on loopback, at a small layout: every row is measured, every load's
bytes checked, the ratios are paired to the right base row, and the profile
splits the wall time without inventing any."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

from layerlift.bench import transfer
from layerlift.bench.transfer_profile import PARTS

pytestmark = pytest.mark.mooncake

SMALL = ["--tokens", "256", "--page-sizes", "16,32", "--layers", "4", "--kv-heads", "2",
         "--head-dim", "64", "--repeats", "2", "--timeout", "30"]


@pytest.fixture(scope="module")
def record(tmp_path_factory: pytest.TempPathFactory) -> dict[str, object]:
    out = tmp_path_factory.mktemp("transfer") / "transfer.json"
    assert transfer.main([*SMALL, "--json", str(out)]) == 0
    data: dict[str, object] = json.loads(Path(out).read_text())
    return data


def test_every_row_is_measured_for_every_case(record: dict[str, object]) -> None:
    cases = record["links"]["mooncake-tcp-loopback"]  # type: ignore[index]
    assert list(cases) == ["256 tokens, page 16", "256 tokens, page 32"]
    for c in cases.values():
        assert list(c["loads"]) == ["raw whole", "raw ranged d1", "in-place d1", "ring d1",
                                    "raw ranged d4", "in-place d4", "ring d4"]
        assert list(c["offloads"]) == ["raw put", "in-place", "ring"]
        for table in ("loads", "offloads"):
            for mode, g in c[table].items():
                assert 0 < g["min"] <= g["median"] <= g["max"], (mode, g)
            # every mode's cores busy: some CPU (the bound is loose: at this size a
            # mode runs for milliseconds, and CPU time of threads running on other
            # cores is accounted a scheduler tick late)
            assert list(c[f"{table} cores"]) == list(c[table])
            for mode, g in c[f"{table} cores"].items():
                assert 0 < g["median"] <= 4 * (os.cpu_count() or 1), (mode, g)
            # the machine's cores: only modes long enough for a scheduler tick
            # in every repeat are kept, each within the machine's CPU count
            assert set(c[f"{table} machine cores"]) <= set(c[table])
            for mode, g in c[f"{table} machine cores"].items():
                assert 0 <= g["min"] <= g["max"] <= (os.cpu_count() or 1) + 1e-6, (mode, g)
        # each ratio is to its own base row: the base rows are exactly 1
        for base in ("raw ranged d1", "raw ranged d4"):
            assert c["loads / ranged"][base] == {"min": 1.0, "median": 1.0, "max": 1.0}
        assert c["loads / whole"]["raw whole"]["median"] == 1.0
        assert c["offloads / raw put"]["raw put"]["median"] == 1.0
        assert c["payload_bytes"] == c["objects"] * 4 * c["slice_bytes"]


def test_the_profile_splits_the_wall_time(record: dict[str, object]) -> None:
    cases = record["links"]["mooncake-tcp-loopback"]  # type: ignore[index]
    for c in cases.values():
        assert set(c["profile"]) == {"in-place load", "ring load", "in-place offload",
                                     "ring offload"}
        for run, p in c["profile"].items():
            assert set(p["ms"]) == set(PARTS)
            assert p["ms"]["store"] > 0, run  # every run calls the store
            if p["overlapped"]:  # the staged offload's put thread runs beside its staging
                assert run == "ring offload" and p["ms"]["python"] == 0, run
                assert sum(p["ms"].values()) > p["wall_ms"], run
            else:
                assert sum(p["ms"].values()) == pytest.approx(p["wall_ms"], abs=0.1), run
        assert c["profile"]["ring load"]["ms"]["copy"] > 0  # the ring path copies
        assert c["profile"]["in-place load"]["ms"]["copy"] == 0  # the in-place one does not
        assert c["profile"]["in-place load"]["ms"]["crc"] > 0  # every byte is verified


def test_the_table_has_every_row(record: dict[str, object]) -> None:
    text = transfer.render_table(record)
    for mode in ("raw whole", "raw ranged d4", "in-place d1", "ring d4", "raw put"):
        assert f"| {mode} |" in text
    assert text.count("| mooncake-tcp-loopback | 256 tokens, page 16 | ring d1 |") == 1
    case = record["links"]["mooncake-tcp-loopback"]["256 tokens, page 16"]  # type: ignore[index]
    (row,) = [line for line in text.splitlines()
              if line.startswith("| mooncake-tcp-loopback | 256 tokens, page 16 | ring |")]
    machine = case["offloads machine cores"].get("ring")
    tail = "-" if machine is None else f"{machine['median']:.2f}"
    assert row.endswith(f"| {case['offloads cores']['ring']['median']:.2f} | {tail} |"), row


def test_a_wrong_byte_in_a_load_fails_the_run() -> None:
    layout = transfer.Layout(2, 1, 32, 2, 4)

    bench = transfer.Bench.__new__(transfer.Bench)
    bench.layout = layout
    bench.src = torch.randint(0, 256, (3, layout.object_bytes), dtype=torch.uint8)
    bench.dst = bench.src.clone()
    bench.check()
    bench.dst[1, 5] ^= 1
    with pytest.raises(RuntimeError, match="wrong bytes"):
        bench.check()


def test_the_checked_raw_read_checks_every_slice() -> None:
    """``raw ranged d4 + check`` (the raw read with LayerLift's check and
    nothing else): exact objects read back exact; one stored byte flipped
    in one object's last layer ends the run, whichever thread read it."""
    from layerlift.linker.memory_store import MemoryStore

    store = MemoryStore()
    bench = transfer.Bench(store, transfer.Layout(4, 2, 16, 2, 16), tokens=128, timeout_s=10.0)
    try:
        for depth in (1, 4):
            bench.raw_ranged(depth, check=True)
            bench.check()
            bench.dst.zero_()
        key = bench.keys[3]
        stored = bytearray(store._objects[key])
        stored[3 * bench.layout.slice + 7] ^= 0x01  # layer 3 of object 3
        store._objects[key] = bytes(stored)
        with pytest.raises(RuntimeError, match="found 1 corrupt slices"):
            bench.raw_ranged(4, check=True)
    finally:
        bench.close()
