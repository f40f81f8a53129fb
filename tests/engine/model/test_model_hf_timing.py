"""The transformers adapter reports per-layer compute, not cumulative time:
requests and chunks run one after another, each chunk brackets every layer
with ``before_layer``/``after_layer``, and the engine sums the stretches."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hf_models import build
from reference import ArrayPool, page_table

from layerlift import Engine, EngineConfig
from layerlift.engine.model import ForwardRequest
from layerlift.engine.model.hf import TransformersModel
from layerlift.linker.memory_store import MemoryStore


@pytest.fixture(scope="module")
def model() -> TransformersModel:
    return build("lara_mini")


def test_every_chunk_of_every_request_brackets_each_layer(model: TransformersModel) -> None:
    """Two requests, the first cut at two capture positions: four passes,
    each with one before/after pair per layer and nothing of another pass
    inside a pair."""
    rng = np.random.default_rng(4)
    a, b = (torch.as_tensor(rng.integers(0, 128, n)) for n in (150, 40))
    pool = ArrayPool(model.spec, max_pages=3 * 256, max_slots=8)
    reqs = [ForwardRequest(a, 0, page_table(0, 10), page_table(0, 10), 0, None, {64: 1, 128: 2}),
            ForwardRequest(b, 0, page_table(1, 3), page_table(1, 3), 3, None, {})]
    events: list[tuple[str, int]] = []
    model.forward_batch(reqs, pool, lambda layer: events.append(("before", layer)),
                        lambda layer: events.append(("after", layer)))
    n = model.spec.num_layers
    assert len(events) == 4 * 2 * n
    open_: set[int] = set()
    for kind, layer in events:
        if kind == "before":
            assert layer not in open_
            open_.add(layer)
        else:
            assert layer in open_, f"after_layer({layer}) without its before_layer"
            open_.discard(layer)
    assert not open_


async def test_engine_timings_sum_to_at_most_the_forward(model: TransformersModel) -> None:
    """With cumulative hooks (before on the first chunk, after on the last)
    layer ``l`` would count everything from its first use to the end: the
    sum over layers exceeded the whole prefill. Per stretch, it cannot."""
    rng = np.random.default_rng(5)
    batch = [rng.integers(0, 128, n).tolist() for n in (150, 205, 90)]
    cfg = EngineConfig(store="memory", pool_bytes=16 << 20, offload=False)
    async with Engine(model, cfg, store=MemoryStore()) as engine:  # type: ignore[arg-type]
        out = await engine.prefill(batch)
    t = out[0].timings
    n = model.spec.num_layers
    assert len(t.layer_compute) == n and len(t.layer_wait) == n
    assert all(c > 0 for c in t.layer_compute)
    # Two recurrent layers of equal cost: no layer holds most of the forward (with
    # one bracket over the whole forward, layer 0 held nearly all of it).
    assert max(t.layer_compute) <= 0.75 * sum(t.layer_compute), t.layer_compute
    assert sum(t.layer_compute) + sum(t.layer_wait) <= t.ttft - t.forward_start + sum(
        t.layer_wait[:1])
