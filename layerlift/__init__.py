"""LayerLift: restore a hybrid LLM's prefix cache from Mooncake Store layer by
layer while the prefill forward runs.

The public API::

    from layerlift import ModelSpec, HybridModel, Engine, EngineConfig

``Model`` is the model protocol; ``layerlift.engine.model.hf.TransformersModel``
(extra ``hf``) wraps a transformers model.
"""

from __future__ import annotations

from layerlift.engine.api import Engine, EngineError
from layerlift.engine.config import EngineConfig
from layerlift.engine.model import HybridModel, Model
from layerlift.engine.plan import LookupPlan
from layerlift.engine.results import PrefillResult, Timings
from layerlift.pools.spec import Component, ModelDims, ModelSpec

__all__ = [
    "Component",
    "Engine",
    "EngineConfig",
    "EngineError",
    "HybridModel",
    "LookupPlan",
    "Model",
    "ModelDims",
    "ModelSpec",
    "PrefillResult",
    "Timings",
]
