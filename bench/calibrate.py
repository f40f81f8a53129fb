"""The ``cpu-measured`` compute profile: the reference model's own per-layer
times on this machine, fitted per layer kind.

:func:`measure` runs the reference :class:`HybridModel` of a preset through
a real :class:`Engine` (no store), one request per prefill, over a grid of
cached-prefix and new-token counts (the prefix comes from the device tree:
an earlier prompt's pages), and records each layer's compute time from the
results' timings. :func:`fit_profile` fits ``a + b * tokens + c * pairs``
per kind (:class:`~layerlift.engine.model.compute_model.FittedCompute`).
The fit is saved as JSON (``save`` / ``load``) so a replay reuses it.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from layerlift.engine.api import Engine
from layerlift.engine.config import EngineConfig
from layerlift.engine.model import HybridModel
from layerlift.engine.model.compute_model import FittedCompute, KindFit, attention_pairs
from layerlift.pools.spec import Component, ModelSpec

__all__ = ["fit_profile", "load", "measure", "save"]

PREFIXES = (0, 256, 1024)
NEW = (16, 64, 256, 1024)


async def measure(preset: str, *, repeats: int = 2, seed: int = 0,
                  prefixes: Sequence[int] = PREFIXES,
                  new: Sequence[int] = NEW) -> list[tuple[Component, int, int, float]]:
    """``(kind, new tokens, attention pairs, seconds)`` per layer of every
    measured forward (pairs over the SWA window for sliding layers)."""
    spec = ModelSpec.preset(preset)
    model = HybridModel(spec, seed=0)
    rng = np.random.default_rng(seed)
    ps = spec.page_size
    samples: list[tuple[Component, int, int, float]] = []
    cfg = EngineConfig(store="memory", offload=False, pool_bytes=256 << 20)
    async with Engine(model, cfg) as eng:
        for _ in range(repeats):
            for p in prefixes:
                for n in new:
                    eng.drop_device_cache()
                    base = rng.integers(0, model.vocab_size, p + ps)  # pages [0, p] cached
                    if p:
                        await eng.prefill([base])
                    prompt = np.concatenate([base[:p], rng.integers(0, model.vocab_size, n)])
                    (res,) = await eng.prefill([prompt])
                    cached = res.device_hit_tokens
                    comp = res.computed_tokens
                    pairs = {Component.FULL: attention_pairs(cached, comp),
                             Component.SWA: attention_pairs(cached, comp, spec.swa_window),
                             Component.MAMBA: 0}
                    for kind, t in zip(spec.kinds, res.timings.layer_compute, strict=True):
                        samples.append((kind, comp, pairs[kind], t))
    return samples


def fit_profile(preset: str, samples: Sequence[tuple[Component, int, int, float]]
                ) -> FittedCompute:
    """The fitted ``cpu-measured`` profile of ``preset``."""
    spec = ModelSpec.preset(preset)
    return FittedCompute(f"cpu-measured:{preset}", FittedCompute.fit(samples), spec.swa_window)


def save(profile: FittedCompute, path: str | Path, meta: dict[str, Any]) -> None:
    data = {"name": profile.name, "window": profile.window, "meta": meta,
            "fits": {k.value: [f.base, f.per_token, f.per_pair] for k, f in profile.fits.items()}}
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(data, indent=1) + "\n")


def load(path: str | Path) -> FittedCompute:
    """A profile written by :func:`save`; ``ValueError`` for another file."""
    try:
        data = json.loads(Path(path).read_text())
        fits = {Component(k): KindFit(*v) for k, v in data["fits"].items()}
        return FittedCompute(str(data["name"]), fits, int(data["window"]))
    except (KeyError, TypeError, json.JSONDecodeError) as exc:
        raise ValueError(f"{path} is not a cpu-measured profile ({exc})") from None
