"""LayerLift's benchmarks, installed as ``layerlift.bench``; each one is a
``layerlift bench NAME`` subcommand with the same output options
(``--json``, ``--markdown``, ``--plot``: :mod:`layerlift.bench.output`).

``BENCHMARKS`` names each subcommand's module (imported only when run) and
its one line of help. ``report`` is not a benchmark: it regenerates
``docs/results.md`` from ``bench/results/*.json``. Nothing in the engine
imports from here; the CLI (``layerlift.cli``) sits above it.
"""

from __future__ import annotations

__all__ = ["BENCHMARKS"]

BENCHMARKS: dict[str, tuple[str, str]] = {
    "ttft": ("layerlift.bench.ttft", "time to first token: recompute vs barrier vs overlap restore"),
    "replay": ("layerlift.bench.replay",
               "the Mooncake conversation trace through the serving loop, per policy"),
    "store": ("layerlift.bench.store", "Mooncake per-layer ranged reads vs whole-object reads"),
    "transfer": ("layerlift.bench.transfer",
                 "LayerLift's staged transfer vs raw Mooncake reads and puts at a real size"),
    "transfer-sglang": ("layerlift.bench.transfer_sglang",
                        "SGLang's two linkers' loads and offloads beside raw Mooncake (.venv-sglang)"),
    "transfer-vllm": ("layerlift.bench.transfer_vllm",
                      "LayerLift's vLLM worker's restores and saves beside raw Mooncake"),
    "sched": ("layerlift.bench.sched", "the load scheduler alone, loads and computes that use no CPU"),
    "overhead": ("layerlift.bench.overhead", "per-layer scheduling overhead of the overlap machinery"),
    "pools": ("layerlift.bench.pools", "tri-pool admission against static splits (equal bytes)"),
    "fleet-grid": ("layerlift.bench.fleet_grid",
                   "the replay through 1-8 simulated instances per router, at three settings"),
    "store-full": ("layerlift.bench.store_full",
                   "a store smaller than the working set: restored fraction against the ideal"),
    "integrity": ("layerlift.bench.integrity",
                  "what the per-layer CRC-32C checks cost: verify throughput, footer reads"),
    "sglang": ("layerlift.bench.sglang_bench",
               "inside SGLang 0.5.23: LayerLiftLinker beside MooncakeDirectLinker (.venv-sglang)"),
    "vllm": ("layerlift.bench.vllm_bench", "TTFT inside vLLM: no connector, vLLM's Mooncake, LayerLift"),
    "report": ("layerlift.bench.results", "regenerate docs/results.md from bench/results/*.json"),
}
