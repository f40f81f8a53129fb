"""Models the engine can run: the protocol, the reference hybrid model and
adapters.

``from layerlift.engine.model import HybridModel`` is the reference model;
``layerlift.engine.model.hf.TransformersModel`` wraps a transformers model
(optional extra ``hf``; imported on demand so the core needs no transformers).
"""

from __future__ import annotations

from layerlift.engine.model.api import ForwardOutput, ForwardRequest, PoolViews
from layerlift.engine.model.base import LayerHook, Model
from layerlift.engine.model.hybrid import HybridModel

__all__ = ["ForwardOutput", "ForwardRequest", "HybridModel", "LayerHook", "Model", "PoolViews"]
