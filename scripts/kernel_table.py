"""The figures behind the architecture tests' oracles, per CPU kernel set.

For every architecture of ``test_model_hf_archs.py`` (same configs, prompts
and engine settings) and each of ``ATEN_CPU_CAPABILITY=default``, ``avx2``
and the machine's own, the largest |delta log-prob| of:

* ``restore``: the restored prefill against LayerLift's first (computed)
  prefill of the same prompts (float32; the test requires 0);
* ``fidelity64``: the engine's cold prefill against transformers'
  ``model(full_ids)``, both in float64 (the test allows 1e-5);
* ``cold32``: the same in float32 (the criterion the tests no longer use).

Run from the repository root: ``.venv/bin/python scripts/kernel_table.py``
(each kernel set in a child process; a markdown table on stdout).
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
SETS = ("default", "avx2", "own")


def _delta(a: Any, b: Any) -> float:
    return float((a - b).abs().max())


async def _measure(arch: str) -> dict[str, float]:
    from hf_models import build, build_float64, cold_logprobs
    from test_model_hf_archs import prompts

    from layerlift import Engine, EngineConfig
    from layerlift.testing import offload_and_drop
    from layerlift.testing.reference import cold_prefills

    batch, model = prompts(), build(arch)
    cfg = EngineConfig(store="memory", namespace=f"arch-{arch}", pool_bytes=16 << 20)
    async with Engine(model, cfg) as engine:
        first = await engine.prefill(batch)
        await offload_and_drop(engine)
        again = await engine.prefill(batch)
    m64, _ = build_float64(arch)
    (cold,) = await cold_prefills(m64, [batch[1]], pool_bytes=16 << 20)
    return {
        "restore": max(_delta(a.next_token_logprobs, f.next_token_logprobs)
                       for a, f in zip(again, first, strict=True)),
        "fidelity64": _delta(cold.next_token_logprobs, cold_logprobs(m64, batch[1])),
        "cold32": max(_delta(f.next_token_logprobs, cold_logprobs(model, t))
                      for f, t in zip(first, batch, strict=True)),
    }


def _one_set() -> None:
    sys.path.insert(0, str(ROOT / "tests/engine/model"))
    from layerlift.engine.model.hf_layout import TESTED_ARCHITECTURES

    out = {arch: asyncio.run(_measure(arch)) for arch in (*TESTED_ARCHITECTURES, "deepseek_v3")}
    print(json.dumps(out))


def _run_set(kernel_set: str) -> dict[str, dict[str, float]]:
    env = {k: v for k, v in os.environ.items() if k != "ATEN_CPU_CAPABILITY"}
    if kernel_set != "own":
        env["ATEN_CPU_CAPABILITY"] = kernel_set
    done = subprocess.run([sys.executable, __file__, "--one"], env=env, cwd=ROOT, check=True,
                          capture_output=True, text=True)
    return json.loads(done.stdout.strip().splitlines()[-1])  # type: ignore[no-any-return]


def main() -> None:
    import torch

    own = torch.backends.cpu.get_cpu_capability().lower()
    table = {s: _run_set(s) for s in SETS}
    names = [s if s != "own" else own for s in SETS]
    cols = ("restore", "fidelity64", "cold32")
    print("| arch | " + " | ".join(f"{c} {n}" for c in cols for n in names) + " |")
    print("|---" * (1 + len(cols) * len(SETS)) + "|")
    for arch in table[SETS[0]]:
        cells = [f"{table[s][arch][c]:.1e}" if table[s][arch][c] else "0"
                 for c in cols for s in SETS]
        print(f"| {arch} | " + " | ".join(cells) + " |")
    for c in cols:
        print(f"max {c}: " + ", ".join(f"{n} {max(r[c] for r in table[s].values()):.2e}"
                                      for s, n in zip(SETS, names, strict=True)))


if __name__ == "__main__":
    _one_set() if sys.argv[1:] == ["--one"] else main()
