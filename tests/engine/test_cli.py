"""The `layerlift` console script: `master --help` and a tiny `bench ttft` grid."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

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


GUIDE = Path(__file__).resolve().parents[2] / "docs" / "guide" / "benchmarks.md"


def _guide_columns() -> list[str]:
    text = GUIDE.read_text()
    start = text.index("### The table's columns")
    section = text[start: text.index("\n#", start + 1)]
    return re.findall(r"^\| `([^`]+)` \|", section, re.M)


def test_the_guide_names_exactly_the_columns_the_cli_prints() -> None:
    from layerlift.bench.report import COLUMNS, format_table

    printed = re.split(r"\s{2,}", format_table([]).splitlines()[0].strip())
    assert printed == list(COLUMNS)
    assert _guide_columns() == printed, "docs/guide/benchmarks.md's column list differs"


def _point(link: str, batch: int, prefix: int, eff: float) -> dict[str, Any]:
    t = {"recompute": 0.3, "barrier": 0.1, "overlap": 0.08}
    return {"link": link, "preset": "small", "prefix_tokens": prefix, "suffix_tokens": 64,
            "batch": batch, "ttft_s": t, "bound_s": 0.09, "efficiency": eff}


def test_a_point_above_the_bound_gets_a_note_with_its_room() -> None:
    from layerlift.bench.report import EFF_ABOVE_1, table_notes

    assert table_notes([_point("x", 1, 512, 0.9)]) == []
    notes = table_notes([_point("x", 1, 512, 2.0), _point("x", 1, 1024, 0.5)])
    assert notes == ["note: x P=512 B=1: eff 2.00 > 1: overlap 80.0 ms < bound 90.0 ms; the "
                     "room T_barrier - bound is 10.0 ms.", EFF_ABOVE_1]


def test_an_overlap_behind_its_barrier_on_shared_cores_says_why_in_one_line() -> None:
    from layerlift.bench.report import table_notes

    behind = {**_point("mooncake-tcp-loopback", 1, 2048, 0.5), "load_s": 0.05, "compute_s": 0.1,
              "ttft_s": {"recompute": 1.4, "barrier": 0.166, "overlap": 0.245}}
    emulated = {**behind, "link": "emulated:0.1GB/s,10us"}
    assert table_notes([_point("mooncake-tcp-loopback", 1, 512, 0.9), emulated]) == []
    [note] = table_notes([behind, emulated])
    assert note.startswith("note: mooncake-tcp-loopback P=2048 B=1: overlap 245.0 ms is behind "
                           "the barrier's 166.0 ms: here Mooncake's reads and the forward run on "
                           "the same CPU cores (the load alone 50.0 ms, the forward alone "
                           "100.0 ms), so")
    assert "\n" not in note
    # with the machine's busy cores measured in each strategy's runs, it says them
    measured = {**behind, "machine_cores": {"recompute": 1.0, "barrier": 1.1, "overlap": 1.9},
                "machine_cpus": 2}
    [note] = table_notes([measured])
    assert ("(the load alone 50.0 ms, the forward alone 100.0 ms); the machine at 1.9 of its "
            "2 cores in the overlap runs, 1.1 in the barrier's, so") in note


def test_plot_legends_are_readable_and_shared_settings_are_in_the_title(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import matplotlib.figure

    from layerlift.bench.report import write_plot

    seen: list[matplotlib.figure.Figure] = []
    real = matplotlib.figure.Figure.savefig

    def keep(self: matplotlib.figure.Figure, *args: Any, **kwargs: Any) -> None:
        seen.append(self)
        real(self, *args, **kwargs)

    monkeypatch.setattr(matplotlib.figure.Figure, "savefig", keep)
    points = [_point(link, b, p, 1.0) for link in ("mooncake-tcp-loopback", "emulated:1GB/s,10us")
              for b in (1, 2) for p in (512, 1024)]
    write_plot(points, str(tmp_path / "p.png"))
    (fig,) = seen
    title = fig._suptitle.get_text()  # type: ignore[union-attr]
    assert "preset small" in title and "suffix 64 tokens" in title and "batch" not in title
    texts = [t for ax in fig.axes for t in ax.get_legend().get_texts()]
    assert texts and all(t.get_fontsize() >= 9 for t in texts)
    labels = [t.get_text() for t in texts]
    assert not any("small" in s or "S=64" in s for s in labels), labels
    assert {"overlap (B=1)", "overlap (B=2)"} <= set(labels)
    assert any("bound:" in t.get_text() and t.get_fontsize() >= 9 for t in fig.texts)


@pytest.mark.mooncake
def test_the_cli_on_mooncake_prints_no_glog_lines() -> None:
    """The console script imports the store before it sets Mooncake's quiet
    defaults: the defaults (and the setup filter) must hold all the same."""
    import os

    env = {k: v for k, v in os.environ.items() if k not in ("MC_LOG_LEVEL", "GLOG_minloglevel")}
    proc = subprocess.run(
        [sys.executable, "-m", "layerlift.cli", "bench", "ttft", "--preset", "tiny", "--prefix",
         "64", "--suffix", "16", "--batch", "1", "--repeats", "1", "--warmup", "0", "--links",
         "mooncake", "--no-progress"], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert not re.findall(r"^[IWE]\d{4} |InitGoogleLogging", proc.stderr, re.M), proc.stderr
