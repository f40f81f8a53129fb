"""examples/serving_loop.py: runs, outputs every token, and its greedy tokens
are the model's (checked against a cold engine)."""

from __future__ import annotations

import importlib.util
import re
import sys
from pathlib import Path
from types import ModuleType

import numpy as np
import pytest

from layerlift import Engine, EngineConfig, HybridModel, ModelSpec

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "serving_loop.py"
LINE = re.compile(r"^req (\d+) ttft_ms=([\d.]+) prompt=(\d+) restored=(\d+) "
                  r"device_hit=(\d+) generated=([\d,]+)$")


@pytest.fixture(scope="module")
def example() -> ModuleType:
    spec = importlib.util.spec_from_file_location("serving_loop_example", EXAMPLE)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses resolve annotations through it
    spec.loader.exec_module(module)
    return module


def test_serving_loop_main(example: ModuleType, capsys: pytest.CaptureFixture[str]) -> None:
    assert example.main(["--store", "memory", "--requests", "5", "--new-tokens", "3",
                         "--max-batch", "2"]) == 0
    out = capsys.readouterr().out.splitlines()
    lines = [m for m in map(LINE.match, out) if m]
    assert sorted(int(m[1]) for m in lines) == list(range(5)), out
    assert all(len(m[6].split(",")) == 3 for m in lines), out
    assert any(int(m[4]) > 0 for m in lines), "the shared prefix was never restored"
    assert out[-1].startswith("served 5 requests, 15 tokens"), out[-1]


async def test_serving_loop_tokens_are_greedy(example: ModuleType) -> None:
    args = example.parse_args(["--requests", "4", "--new-tokens", "3", "--max-batch", "3"])
    done = await example.amain(args)
    assert [len(r.generated) for r in done] == [3] * 4
    # Reference: a cold engine, every prefix of every generation at once.
    model = HybridModel(ModelSpec.preset(args.preset), seed=args.seed)
    seqs = [np.concatenate([r.prompt, np.asarray(r.generated[:i], dtype=np.int64)])
            for r in done for i in range(3)]
    async with Engine(model, EngineConfig(store="memory", offload=False)) as engine:
        ref = await engine.prefill(seqs)
    want = [int(x.next_token_logprobs.argmax()) for x in ref]
    assert [t for r in done for t in r.generated] == want
