"""vLLM 0.33 (its GPU build) on this CPU machine: vLLM picks its CPU platform
(``VLLM_TARGET_DEVICE=cpu``, set before vLLM is imported) unless CUDA is
there; one `ModelConfig` of a tiny model (a ``config.json``, no weights)
serves every test."""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")

import pytest
from vllm033_sched import model_config, tiny_model_dir


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> object:
    """vLLM 0.33's `ModelConfig` of the tiny llama (built once)."""
    return model_config(tiny_model_dir(tmp_path_factory.mktemp("tiny033")))
