"""Host tests (SGLang, vLLM) run in each host's own environment.

``make test`` runs them there (``.venv-sglang``, ``.venv-vllm``, each built by
its ``scripts/setup_*.sh``) with ``LAYERLIFT_HOST_TESTS`` naming the hosts that
must run. A folder whose host is not importable here is not collected (the
main environment has neither host); where ``LAYERLIFT_HOST_TESTS`` names it,
a missing host is an error, never a skip. Test files that need no host
(``_WITHOUT_HOST``: the vLLM worker's device path imports no vLLM) are
collected anyway, so a GPU machine with torch but neither host runs their
``gpu`` tests (``pytest -m gpu``, ``bench/gpu_check.sh``).
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

_FOLDERS = {"sglang": "sglang_host", "vllm": "vllm_host"}
_WITHOUT_HOST = {"vllm_host": {"test_vllm_device.py"}}  # files that import no host
_required = {h for h in os.environ.get("LAYERLIFT_HOST_TESTS", "").split(",") if h}

unknown = _required - set(_FOLDERS)
if unknown:
    raise RuntimeError(f"LAYERLIFT_HOST_TESTS names unknown hosts {sorted(unknown)}; "
                       f"choose from {sorted(_FOLDERS)}")

collect_ignore: list[str] = []
for _host, _folder in _FOLDERS.items():
    if importlib.util.find_spec(_host) is not None:
        continue
    if _host in _required:
        raise RuntimeError(
            f"LAYERLIFT_HOST_TESTS requires the {_host} tests, but {_host} is not importable "
            f"in this environment; build it with scripts/setup_{_host}.sh")
    keep = _WITHOUT_HOST.get(_folder, set())
    if not keep:
        collect_ignore.append(_folder)
        continue
    folder = Path(__file__).parent / _folder
    collect_ignore += [f"{_folder}/{p.name}" for p in sorted(folder.iterdir())
                       if p.name not in keep and p.name != "__pycache__"]
