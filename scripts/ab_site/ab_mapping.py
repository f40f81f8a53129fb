"""Point the editable install's mapping of ``layerlift.*`` at another
checkout: what ``scripts/ab_run.py`` does in its own process and
``sitecustomize.py`` in every process it starts."""

from __future__ import annotations

import importlib
from pathlib import Path


def point_at(root: str | Path) -> bool:
    """Map every ``layerlift.*`` package of the editable install to the same
    folder under ``root``; False where this environment has no such install
    (a host's venv without layerlift)."""
    try:
        finder = importlib.import_module("__editable___layerlift_0_1_0_finder")
    except ImportError:
        return False
    mapping: dict[str, str] = finder.MAPPING
    for name, path in list(mapping.items()):
        mapping[name] = str(Path(root) / Path(path).name)
    return True
