"""Every CLI error is one line on stderr with exit status 2, naming the
option and what it accepts; ``--help`` shows real defaults and a help text
for every option; ``layerlift --version`` prints the version.

The CLI's ``main()`` runs in-process (a benchmark's usage error raises
``SystemExit(2)``, as argparse does; the console script exits with it): each bad input must be refused before
any benchmark work starts (a case that ran would take far longer than this
module's budget and fail the one-line check with its table).
"""

from __future__ import annotations

import argparse
import importlib
import importlib.metadata

import pytest
import torch

from layerlift.bench import BENCHMARKS
from layerlift.cli import main


def run(argv: list[str]) -> int | str | None:
    """``main(argv)``'s exit status, whether returned or raised."""
    try:
        return main(argv)
    except SystemExit as exc:
        return exc.code


CUDA = "cuda:64" if torch.cuda.is_available() else "cuda"

# (argv, words the one line must contain)
CASES: list[tuple[list[str], list[str]]] = [
    ([], ["name a command", "master"]),
    (["nonsense"], ["unknown command", "bench"]),
    (["bench"], ["name a benchmark", "ttft"]),
    (["bench", "nope"], ["unknown benchmark", "ttft"]),
    (["master", "--rpc-port", "x"], ["--rpc-port", "invalid int value"]),
    (["store-node", "--bytes", "1G"], ["required", "--master"]),
    (["bench", "ttft", "--batch", "0"], ["--batch", "integers >= 1"]),
    (["bench", "ttft", "--batch", "1,x"], ["--batch", "integers >= 1"]),
    (["bench", "ttft", "--preset", "nope"], ["--preset", "'nope'", "small"]),
    (["bench", "ttft", "--model", "nope"], ["--model", "hf:<arch>"]),
    (["bench", "ttft", "--device", CUDA], ["--device", "cpu"]),
    (["bench", "ttft", "--device", "gpu"], ["--device", "cuda:N"]),
    (["bench", "ttft", "--links", "bogus"], ["--links", "'bogus'", "emulated:GBPS[,LATENCY_US]",
                                             "gigabytes per second", "microseconds"]),
    (["bench", "ttft", "--links", "emulated:abc"], ["--links", "'emulated:abc'", "mooncake"]),
    (["bench", "ttft", "--links", "emulated:0"], ["--links", "'emulated:0'"]),
    (["bench", "ttft", "--links", "netns:fast"], ["--links", "netns:RATE"]),
    (["bench", "ttft", "--prefix", "abc"], ["--prefix", "integers >= 1"]),
    (["bench", "ttft", "--prefix", "50", "--preset", "tiny"], ["--prefix", "checkpoint interval"]),
    (["bench", "ttft", "--suffix", "0"], ["--suffix", "integers >= 1"]),
    (["bench", "ttft", "--repeats", "0"], ["--repeats", "integer >= 1"]),
    (["bench", "ttft", "--warmup", "-1"], ["--warmup", "integer >= 0"]),
    (["bench", "ttft", "--threads", "0"], ["--threads", "integer >= 1"]),
    (["bench", "ttft", "--no-such-option"], ["unrecognized arguments", "--no-such-option"]),
    (["bench", "store", "--repeats", "0"], ["--repeats", "integer >= 1"]),
    (["bench", "store", "--bytes", "abc"], ["--bytes", "integer"]),
    (["bench", "store", "--netns", "fast"], ["--netns", "1gbit"]),
    (["bench", "integrity", "--repeats", "x"], ["--repeats", "integer >= 1"]),
    (["bench", "store-full", "--fractions", "2"], ["--fractions", "(0, 1]"]),
    (["bench", "store-full", "--preset", "nope"], ["--preset", "'nope'"]),
    (["bench", "store-full", "--prompts", "0"], ["--prompts", "integer >= 1"]),
    (["bench", "sched", "--profile", "/nonexistent.json"], ["--profile", "/nonexistent.json"]),
    (["bench", "sched", "--point", "-1"], ["--point", "integer >= 0"]),
    (["bench", "sched", "--repeats", "0"], ["--repeats", "integer >= 1"]),
    (["bench", "overhead", "--max-in-flight", "0"], ["--max-in-flight", "integer >= 1"]),
    (["bench", "overhead", "--stream-size", "x"], ["--stream-size", "integer >= 1"]),
    (["bench", "pools", "--requests", "0"], ["--requests", "integer >= 1"]),
    (["bench", "pools", "--live", "abc"], ["--live", "integer >= 1"]),
    (["bench", "report", "--results", "/nonexistent"], ["--results", "no results page"]),
]


@pytest.mark.parametrize("argv,words", CASES, ids=[" ".join(a) or "(none)" for a, _ in CASES])
def test_a_bad_input_is_one_line_and_status_2(argv: list[str], words: list[str],
                                              capsys: pytest.CaptureFixture[str]) -> None:
    rc = run(argv)
    out, err = capsys.readouterr()
    assert rc == 2, f"exit status {rc}; stderr: {err!r}"
    assert "Traceback" not in err and not out, (out, err)
    lines = err.splitlines()
    assert len(lines) == 1, f"{len(lines)} lines on stderr:\n{err}"
    missing = [w for w in words if w not in lines[0]]
    assert not missing, f"{missing} not in {lines[0]!r}"


def test_report_check_outside_the_repository(tmp_path: pytest.TempPathFactory,
                                             monkeypatch: pytest.MonkeyPatch,
                                             capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.chdir(tmp_path)  # type: ignore[arg-type]
    assert run(["bench", "report", "--check"]) == 2
    err = capsys.readouterr().err
    assert "there is no results page to check" in err and "stale" not in err


def test_version(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--version"]) == 0
    assert capsys.readouterr().out == f"layerlift {importlib.metadata.version('layerlift')}\n"


MINE = ["ttft", "store", "integrity", "store-full", "sched", "overhead", "pools", "report"]


@pytest.mark.parametrize("name", MINE)
def test_help_has_a_text_for_every_option_and_only_real_defaults(name: str) -> None:
    module = importlib.import_module(BENCHMARKS[name][0])
    parser: argparse.ArgumentParser = module.build_parser()
    bare = [a.option_strings for a in parser._actions if not a.help]
    assert not bare, f"options without help: {bare}"
    text = parser.format_help()
    for fake in ("(default: None)", "(default: True)", "(default: False)", "(default: [",
                 "%(default)"):
        assert fake not in text, f"{fake!r} in layerlift bench {name} --help"


def test_ttft_help_names_the_defaults_chosen_later() -> None:
    from layerlift.bench.ttft import build_parser

    text = " ".join(build_parser().format_help().split())
    assert "prefix lengths in tokens, restored (default: 512,1024,2048,4096; with --quick: " \
           "512,1024,2048)" in text
    assert "(default: mooncake,emulated:0.1,10)" in text and "gigabytes/s" in text
    assert "--seed SEED prompt seed (default: 0)" in text
