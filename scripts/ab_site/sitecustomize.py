"""Loaded at start-up by every Python process that ``scripts/ab_run.py``
starts, directly or not (it puts this folder on ``PYTHONPATH``): where
``LAYERLIFT_AB_ROOT`` is set, the editable install's mapping of
``layerlift.*`` points at that checkout instead of the main one. Without it
a benchmark's child processes (a namespace link's engine host, vLLM's
connector's child) would run the main checkout's code while the parent
ran the other commit's."""

from __future__ import annotations

import importlib
import os
from pathlib import Path

_root = os.environ.get("LAYERLIFT_AB_ROOT")
if _root:
    try:
        _finder = importlib.import_module("__editable___layerlift_0_1_0_finder")
    except ImportError:  # another environment (a host's venv without layerlift)
        pass
    else:
        for _name, _path in list(_finder.MAPPING.items()):
            _finder.MAPPING[_name] = str(Path(_root) / Path(_path).name)
