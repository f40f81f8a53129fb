"""The trace replay: parsing, both samplings, block mapping, the ideal hit
fraction, and a tiny end-to-end replay through the serving loop."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from layerlift.bench import trace as tr
from layerlift.bench.replay import POLICIES, main
from layerlift.cli import main as cli_main

SMALL = Path(__file__).resolve().parents[1] / "data" / "conversation_trace_small.jsonl"


def req(index: int, ids: tuple[int, ...], length: int, ts: float = 0.0) -> tr.TraceRequest:
    return tr.TraceRequest(index, ts, length, 1, ids)


def test_load_trace_reads_every_field() -> None:
    trace = tr.load_trace(SMALL)
    assert len(trace) == 42
    first = trace[0]
    assert first.hash_ids[0] == 0 and first.input_length == 6758 and first.timestamp_ms == 0
    assert [r.index for r in trace] == list(range(42))
    assert all(len(r.hash_ids) == -(-r.input_length // 512) for r in trace)


def test_malformed_line_names_its_line(tmp_path: Path) -> None:
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"timestamp": 0, "input_length": 5, "hash_ids": [1]}\n{"timestamp": 1}\n')
    with pytest.raises(ValueError, match=r"bad.jsonl:2: not a trace record"):
        tr.load_trace(bad)


def test_window_takes_consecutive_requests() -> None:
    trace = tr.load_trace(SMALL)
    got = tr.sample_window(trace, 5, start=3)
    assert [r.index for r in got] == [3, 4, 5, 6, 7]
    with pytest.raises(ValueError, match="start"):
        tr.sample_window(trace, 5, start=42)


def test_families_are_whole_seeded_and_in_trace_order() -> None:
    trace = tr.load_trace(SMALL)
    got = tr.sample_families(trace, 10, seed=1)
    assert len(got) >= 10
    keys = {tr.family_key(r) for r in got}
    for k in keys:  # whole families of at least 3
        members = [r for r in trace if tr.family_key(r) == k]
        assert len(members) >= 3 and all(m in got for m in members)
    assert [(r.timestamp_ms, r.index) for r in got] == sorted((r.timestamp_ms, r.index)
                                                             for r in got)
    assert got == tr.sample_families(trace, 10, seed=1)
    seeds = {tuple(r.index for r in tr.sample_families(trace, 10, seed=s)) for s in range(6)}
    assert len(seeds) > 1  # the seed picks the families
    with pytest.raises(ValueError, match="no family of 50"):
        tr.sample_families(trace, 10, seed=1, min_family=50)


def test_blocks_share_tokens_exactly_where_the_trace_says() -> None:
    reqs = [req(0, (5, 6, 7), 1200), req(1, (5, 6, 9, 10), 1800), req(2, (5, 8), 600)]
    a, b, c = tr.scale(reqs, block_tokens=32, vocab_size=512, seed=4)
    assert [len(x.tokens) for x in (a, b, c)] == [75, 113, 38]  # ceil(len * 32 / 512)
    assert a.block_sizes == (32, 32, 11) and b.block_sizes == (32, 32, 32, 17)
    assert np.array_equal(a.tokens[:64], b.tokens[:64])
    assert not np.array_equal(a.tokens[64:75], b.tokens[64:75])
    assert np.array_equal(a.tokens[:32], c.tokens[:32])
    assert not np.array_equal(a.tokens[32:38], c.tokens[32:38])
    again = tr.scale(reqs, block_tokens=32, vocab_size=512, seed=4)
    assert all(np.array_equal(x.tokens, y.tokens) for x, y in zip((a, b, c), again, strict=True))
    other = tr.scale(reqs, block_tokens=32, vocab_size=512, seed=5)
    assert not np.array_equal(a.tokens, other[0].tokens)


def test_scaled_clock() -> None:
    reqs = [req(0, (1,), 10, ts=1000.0), req(1, (2,), 10, ts=3000.0)]
    got = tr.scale(reqs, block_tokens=16, vocab_size=512, time_scale=4.0)
    assert [x.arrival_s for x in got] == [0.0, 0.5]


def test_ideal_hit_fraction_on_a_hand_made_trace() -> None:
    reqs = [req(0, (1, 2), 1024), req(1, (1, 2, 3), 1280), req(2, (1, 4), 768)]
    scaled = tr.scale(reqs, block_tokens=16, vocab_size=512)
    # sizes: (16, 16), (16, 16, 8), (16, 8); hits: request 1 blocks 1, 2; request 2 block 1.
    assert tr.ideal_hit_fraction(scaled) == pytest.approx((16 + 16 + 16) / (32 + 40 + 24))
    # A partial block is a hit only when an earlier request had as many of its tokens.
    part = tr.scale([req(0, (1, 2), 700), req(1, (1, 2), 1024)], block_tokens=16,
                    vocab_size=512)
    assert tr.ideal_hit_fraction(part) == pytest.approx(16 / (22 + 32))
    assert tr.block_hit_fraction(reqs) == pytest.approx(3 / 7)


def test_tiny_replay_end_to_end(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Two instances (one alone would hold this small sample whole, see the
    refusal below), every policy, progress and the raised pool on stderr."""
    out = tmp_path / "replay.json"
    code = main(["--trace", str(SMALL), "--requests", "8", "--seed", "3", "--block-tokens", "32",
                 "--time-scale", "1000000", "--instances", "2",
                 "--policies", "device-only,overlap,overlap+prefetch,overlap+auto",
                 "--kl-samples", "3", "--pool-fraction", "0.3", "--json", str(out)])
    assert code == 0
    err = capsys.readouterr().err
    assert "[1/4] device-only: " in err and "[4/4] overlap+auto: " in err
    assert "note: the pool was raised from 0.30 of the working set" in err
    got = json.loads(out.read_text())
    assert got["scaling"]["pool_raised"] and "less is evicted" in got["scaling"]["pool_note"]
    assert got["scaling"]["host_rates"]["crc_s_per_byte"] > 0
    assert {"policies", "ideal_hit_fraction", "max_kl", "scaling"} <= set(got)
    assert list(got["policies"]) == ["device-only", "overlap", "overlap+prefetch", "overlap+auto"]
    keys = {"ttft_p50_s", "ttft_p90_s", "ttft_p99_s", "queue_p90_s", "within_slo_fraction",
            "served_from_cache_fraction", "tokens", "prompt_tokens_per_s",
            "offered_tokens_per_s", "served_s"}
    total = None
    for p in got["policies"].values():
        assert set(p) == keys
        assert set(p["tokens"]) == {"device_hit", "restored", "computed"}
        assert 0 < p["ttft_p50_s"] <= p["ttft_p90_s"] <= p["ttft_p99_s"]
        tokens = sum(p["tokens"].values())
        assert total is None or tokens == total
        total = tokens
    assert got["policies"]["device-only"]["tokens"]["restored"] == 0
    assert got["max_kl"] <= 1e-9
    assert got["details"]["overlap+prefetch"]["prefetch_supported"] is True
    assert got["details"]["overlap"]["branch_checkpoints"] is True
    assert 0 < got["ideal_hit_fraction"] < 1
    assert got["scaling"]["block_tokens"] == 32 and got["scaling"]["requests"] >= 8
    put = got["details"]["overlap"]["host_cost"]
    assert put["put_bytes"] > 0 and put["put_host_s"] == 0.0  # token scale 1: nothing missing


def test_a_replay_where_nothing_can_be_restored_is_refused(
        capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["--trace", str(SMALL), "--requests", "8", "--block-tokens", "32",
              "--policies", "barrier,overlap", "--pool-fraction", "0.3"])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err
    assert "nothing would be evicted, so no policy would restore anything" in err


@pytest.mark.parametrize(("args", "says"), [
    (["--trace", "/nonexistent.jsonl"], "--trace /nonexistent.jsonl: no such file"),
    (["--model", "simulated", "--arch", "qwen3-next-80b-a3b", "--gpus", "1",
      "--block-tokens", "8"], "do not fit 1 x h100"),
    (["--model", "simulated", "--arch", "nemotron-h-8b", "--block-tokens", "48"],
     "--block-tokens must divide 512"),
    (["--requests", "0"], "--requests and --block-tokens must be >= 1"),
])
def test_bad_input_is_one_line_and_status_2(args: list[str], says: str,
                                             capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        main(args)
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and says in err and "Traceback" not in err


def test_the_trace_ships_with_the_project() -> None:
    path = tr.default_trace_path()
    assert path.is_file() and path.is_relative_to(Path(tr.__file__).resolve().parent)
    trace = tr.load_trace(path)
    assert len(trace) == 12031 and trace[0].input_length == 6758


def test_simulated_fleet_replay(tmp_path: Path) -> None:
    """Four simulated Qwen3-Next instances on one store behind the 25 Gbit
    profile, routed by round-robin: a turn lands where its prefix is not on
    the device, so some tokens are restored from the store; results exact."""
    out = tmp_path / "fleet.json"
    code = main(["--trace", str(SMALL), "--requests", "10", "--seed", "3", "--block-tokens", "16",
                 "--time-scale", "1000", "--model", "simulated", "--arch", "qwen3-next-80b-a3b",
                 "--device", "h100", "--network", "tcp25", "--instances", "4",
                 "--router", "round-robin", "--policies", "overlap", "--batch-tokens", "512",
                 "--kl-samples", "3", "--slo-ms", "2000", "--json", str(out), "--quiet"])
    assert code == 0
    got = json.loads(out.read_text())
    st = got["setting"]
    assert st["simulated"] and st["token_scale"] == 32 and st["gpus"] == 4
    assert st["links"] == ["emulated:0.35,50"]  # 2.8 GB/s * 4 NICs / 32
    assert got["fleet"] == {"instances": 4, "router": "round-robin", "slo_ms": 2000.0}
    d = got["details"]["overlap"]
    assert sum(d["requests_per_instance"]) == got["scaling"]["requests"]
    assert all(n > 0 for n in d["requests_per_instance"])
    assert got["policies"]["overlap"]["tokens"]["restored"] > 0
    assert got["max_kl"] <= 1e-9
    assert d["loop_lag"]["arrival_p99_s"] >= 0 and d["loop_lag"]["probe_p99_s"] >= 0


def test_cli_dispatches_replay(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        cli_main(["bench", "replay", "--help"])
    assert exc.value.code == 0
    text = capsys.readouterr().out
    assert "--pool-fraction" in text and "--instances" in text and "--router" in text
    assert set(POLICIES) == {"device-only", "barrier", "overlap", "overlap+prefetch",
                             "overlap+auto"}
