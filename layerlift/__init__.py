"""LayerLift: restore a hybrid LLM's prefix cache from Mooncake Store layer by
layer while the prefill forward runs.

The public API::

    from layerlift import ModelSpec, HybridModel, Engine, EngineConfig
"""

from __future__ import annotations

from layerlift.engine.api import DebugSwitches, Engine, EngineError
from layerlift.engine.config import EngineConfig
from layerlift.engine.model import HybridModel
from layerlift.engine.plan import LookupPlan
from layerlift.engine.results import PrefillResult, Timings
from layerlift.pools.spec import Component, ModelSpec

__all__ = [
    "Component",
    "DebugSwitches",
    "Engine",
    "EngineConfig",
    "EngineError",
    "HybridModel",
    "LookupPlan",
    "ModelSpec",
    "PrefillResult",
    "Timings",
]
