"""Every ```python block of README.md runs, as a newcomer would copy it.

Each block runs on its own in a fresh interpreter (so a block must carry its
own imports), with a timeout: the first thing a user copies must work, and
must not hang (the step-by-step example once waited forever).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

README = Path(__file__).resolve().parents[1] / "README.md"
BLOCK = re.compile(r"^```python\n(.*?)^```", re.S | re.M)
TIMEOUT_S = 240


def _blocks() -> list[tuple[str, str]]:
    text = README.read_text()
    out = []
    for m in BLOCK.finditer(text):
        line = text.count("\n", 0, m.start()) + 1
        heading = [h for h in re.findall(r"^#+ (.*)$", text[: m.start()], re.M)][-1:]
        out.append((f"line{line}-{(heading or ['top'])[0][:30]}", m.group(1)))
    return out


BLOCKS = _blocks()


def test_the_readme_has_python_examples() -> None:
    assert len(BLOCKS) >= 2, "README.md lost its python examples"


@pytest.mark.mooncake
@pytest.mark.parametrize("code", [c for _, c in BLOCKS], ids=[n for n, _ in BLOCKS])
def test_readme_block_runs(code: str, tmp_path: Path) -> None:
    script = tmp_path / "block.py"
    script.write_text(code)
    env = {**os.environ, "GLOG_minloglevel": "2", "MC_LOG_LEVEL": "ERROR"}
    proc = subprocess.run([sys.executable, str(script)], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=TIMEOUT_S, check=False)
    assert proc.returncode == 0, (
        f"README block failed (exit {proc.returncode}):\n{code}\n--- stdout\n"
        f"{proc.stdout[-3000:]}\n--- stderr\n{proc.stderr[-3000:]}")
