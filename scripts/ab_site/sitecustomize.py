"""Loaded at start-up by every Python process that ``scripts/ab_run.py``
starts, directly or not (it puts this folder on ``PYTHONPATH``): where
``LAYERLIFT_AB_ROOT`` is set, the editable install's mapping of
``layerlift.*`` points at that checkout instead of the main one. Without it
a benchmark's child processes (a namespace link's engine host, vLLM's
connector's child) would run the main checkout's code while the parent
ran the other commit's."""

from __future__ import annotations

import os

from ab_mapping import point_at

_root = os.environ.get("LAYERLIFT_AB_ROOT")
if _root:
    point_at(_root)
