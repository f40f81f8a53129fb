"""Every benchmark is a `layerlift bench NAME` with the same output options, and
docs/results.md is what the JSON records give (regenerate: `layerlift bench report`)."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

from layerlift.bench import BENCHMARKS
from layerlift.bench.results import build_page, headline, kind_of, plot, render
from layerlift.cli import main

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("name", [n for n in BENCHMARKS if n != "report"])
def test_every_benchmark_takes_the_same_output_options(
        name: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["bench", name, "--help"])
    assert exc.value.code == 0
    out = capsys.readouterr().out
    assert f"layerlift bench {name}" in out
    for option in ("--json", "--markdown", "--plot"):
        assert option in out, f"layerlift bench {name} lacks {option}"


def test_unknown_benchmark_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "nonsense"]) == 2
    assert "choose from ttft" in capsys.readouterr().err


def test_plot_without_matplotlib_is_refused_before_the_run(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # The hosts' environments have no matplotlib: a run asked for a plot
    # there must stop at once, not after its minutes of measuring.
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "matplotlib" else real(name, *a))
    js = tmp_path / "p.json"
    with pytest.raises(SystemExit) as exc:
        main(["bench", "pools", "--requests", "40", "--json", str(js),
              "--plot", str(tmp_path / "p.png")])
    assert exc.value.code == 2
    assert "needs matplotlib, which this environment lacks" in capsys.readouterr().err
    assert not js.exists()


def test_a_run_writes_its_record_table_and_plot(tmp_path: Path) -> None:
    js, md, png = tmp_path / "p.json", tmp_path / "p.md", tmp_path / "p.png"
    assert main(["bench", "pools", "--requests", "40", "--json", str(js),
                 "--markdown", str(md), "--plot", str(png)]) == 0
    record = json.loads(js.read_text())
    assert record["benchmark"] == "pools" and kind_of(record) == "pools"
    assert record["meta"]["command"].startswith("layerlift bench pools --requests 40")
    assert md.read_text() == render(record) + "\n"
    assert png.read_bytes()[:4] == b"\x89PNG"


def test_results_page_is_generated_from_the_json() -> None:
    page = ROOT / "docs" / "results.md"
    assert page.read_text() == build_page(ROOT / "bench" / "results"), (
        "docs/results.md differs from bench/results/*.json: run `layerlift bench report`")


def test_every_record_names_its_benchmark_and_command() -> None:
    records = 0
    for path in sorted((ROOT / "bench" / "results").rglob("*.json")):
        record = json.loads(path.read_text())
        try:
            kind = kind_of(record)
        except ValueError:
            continue  # an input such as a calibration profile: listed, not tabled
        records += 1
        assert kind in BENCHMARKS, f"{path.name}: `layerlift bench {kind}` is not registered"
        assert record.get("meta", {}).get("command", "").startswith("layerlift bench "), path.name
    assert records >= 6


def test_readme_headline_is_the_make_bench_record() -> None:
    record = json.loads((ROOT / "bench" / "results" / "ttft_quick.json").read_text())
    assert headline(record) in (ROOT / "README.md").read_text(), (
        "README.md's headline figure differs from bench/results/ttft_quick.json")


def test_kind_of_refuses_what_no_benchmark_wrote() -> None:
    with pytest.raises(ValueError, match="not a LayerLift benchmark record"):
        kind_of({"rows": []})


def test_a_benchmark_without_a_table_shows_its_scalars_and_has_no_plot(tmp_path: Path) -> None:
    record = {"benchmark": "newbench", "gbps": {"crc32": 3.04, "torch": 0.31}, "ok": True,
              "meta": {"command": "layerlift bench newbench"}}
    text = render(record)
    assert "| gbps.crc32 | 3.04 |" in text and "| ok | True |" in text and "command" not in text
    with pytest.raises(ValueError, match="no plot for benchmark 'newbench'"):
        plot(record, str(tmp_path / "x.png"))
