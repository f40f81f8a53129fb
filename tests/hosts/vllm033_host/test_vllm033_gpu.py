"""vLLM 0.33 end to end on a GPU: LayerLiftConnector restores in a new instance.

Needs CUDA, vLLM 0.33 and Mooncake in one environment (skipped without
CUDA; `bench/gpu_check.sh` runs it where all three import). Per model (tiny,
seeded random weights: ``llama``, one KV cache group, synchronous; ``gemma3``,
sliding + full attention, with `LayerLiftScheduler`, synchronous too), a
cold instance without a connector gives the reference first-token logprobs
of prompts Q1, Q2 (Pi plus 50 tokens); instance A serves P1, P2 and
offloads them to a real master; a new instance B reports the restored
prefix as cached and answers exactly as the cold one. The store's memory is
a segment of this test process, so it outlives A."""

from __future__ import annotations

import random
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from layerlift.linker.master import EmbeddedMaster
from layerlift.testing.vllm_verify import Instance, make_tiny_model

pytestmark = [pytest.mark.vllm033, pytest.mark.gpu, pytest.mark.timeout(1800),
              pytest.mark.skipif(not torch.cuda.is_available(),
                                 reason="no CUDA device on this machine")]

SCHED = "layerlift.hosts.vllm.LayerLiftScheduler"
PREFIX = 384  # tokens of each prompt's shared prefix: whole pages at any block size <= 128


@pytest.fixture(scope="module")
def master(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EmbeddedMaster]:
    log = tmp_path_factory.mktemp("mooncake-vllm033") / "mooncake_master.log"
    with EmbeddedMaster(log_path=log, lease_ttl_ms=5000) as m:
        from layerlift.linker.mooncake_store import MooncakeStore

        holder = MooncakeStore(m.config(global_segment_size=256 << 20,
                                        local_buffer_size=16 << 20))
        try:
            yield m
        finally:
            holder.close()


def _prompts(seed: int) -> tuple[list[list[int]], list[list[int]]]:
    rng = random.Random(seed)
    ps = [[rng.randrange(3, 500) for _ in range(PREFIX)] for _ in range(2)]
    return ps, [p + [rng.randrange(3, 500) for _ in range(50)] for p in ps]


@pytest.mark.parametrize("kind, sched", [("llama", ""), ("gemma3", SCHED)])
def test_a_new_instance_restores_exactly_on_cuda(kind: str, sched: str, master: EmbeddedMaster,
                                                 tmp_path: Path) -> None:
    model = make_tiny_model(kind, str(tmp_path / kind))
    ps, qs = _prompts(seed=len(kind))
    extra = {"store": f"mooncake://{master.master_address}", "metadata": master.metadata_url,
             "namespace": f"g033-{kind}", "store_timeout_s": 5.0, "layer_wait_timeout_s": 20.0}
    results: dict[str, Any] = {}
    cold = Instance(model, "none", None, tmp_path / "cold.log", in_process=True)
    try:
        results["cold"] = cold.generate(qs)
    finally:
        cold.close()
    a = Instance(model, "layerlift", extra, tmp_path / "a.log", scheduler_cls=sched)
    try:
        a.generate(ps)
    finally:
        a.close()
    b = Instance(model, "layerlift", extra, tmp_path / "b.log", scheduler_cls=sched)
    try:
        results["b"] = b.generate(qs)
        log = b.log_text()
    finally:
        b.close()
    assert "synchronous loads" in log, log[-3000:]
    for cold_r, got in zip(results["cold"], results["b"], strict=True):
        assert got["num_cached_tokens"] >= PREFIX - 128, (got, log[-3000:])
        assert got["token"] == cold_r["token"]
        assert got["logprobs"].keys() == cold_r["logprobs"].keys()
        for tok, lp in cold_r["logprobs"].items():
            assert abs(got["logprobs"][tok] - lp) < 1e-4, (tok, got, cold_r)
