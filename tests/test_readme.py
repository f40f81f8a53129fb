"""Every ```python block of README.md and docs/**/*.md runs, as a newcomer
would copy it.

Each block runs on its own in a fresh interpreter (so a block must carry its
own imports), with a timeout: the first thing a user copies must work, and
must not hang (the step-by-step example once waited forever). A block that
cannot run here says so on the line before it, with the reason:
``<!-- test: skip (needs a Mooncake cluster at 10.0.0.5) -->``; it is then
reported as skipped, never silently dropped.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
BLOCK = re.compile(r"^(?:<!-- test: skip \((?P<skip>[^)]*)\) -->\n)?```python\n(?P<code>.*?)^```",
                   re.S | re.M)
TIMEOUT_S = 240


def _blocks() -> list[tuple[str, str, str | None]]:
    out = []
    for page in PAGES:
        text = page.read_text()
        for m in BLOCK.finditer(text):
            line = text.count("\n", 0, m.start("code"))
            out.append((f"{page.relative_to(ROOT)}:{line}", m["code"], m["skip"]))
    return out


BLOCKS = _blocks()


def test_the_readme_has_python_examples() -> None:
    readme = [name for name, _, _ in BLOCKS if name.startswith("README.md:")]
    assert len(readme) >= 2, "README.md lost its python examples"


README_MAX_LINES = 250
GUIDES = sorted((ROOT / "docs" / "guide").glob("*.md"))


def test_the_readme_reads_in_five_minutes() -> None:
    """What a user reads first stays short: the two commands CI and the
    headline script rely on, and a link to every guide; the rest lives in
    docs/."""
    text = (ROOT / "README.md").read_text()
    lines = text.count("\n")
    assert lines <= README_MAX_LINES, f"README.md has {lines} lines (at most {README_MAX_LINES})"
    assert "make bench   # the main job" in text and "make test    # " in text
    assert "**Headline:**" in text  # scripts/readme_headline.py rewrites the figure after it
    unlinked = [g.name for g in GUIDES if f"docs/guide/{g.name}" not in text]
    assert not unlinked, f"README.md links no guide {unlinked}"


def test_skips_are_few_and_give_a_reason() -> None:
    skipped = [(name, why) for name, _, why in BLOCKS if why is not None]
    assert all(why.strip() for _, why in skipped)
    assert len(skipped) <= max(1, len(BLOCKS) // 5), f"too many skipped blocks: {skipped}"


def _param(name: str, code: str, skip: str | None) -> object:
    # A block that runs is a Mooncake test (most start an embedded master),
    # which conftest forbids to skip; a block marked skip is not one.
    mark = pytest.mark.skip(reason=skip) if skip is not None else pytest.mark.mooncake
    return pytest.param(code, marks=mark, id=name)


@pytest.mark.parametrize("code", [_param(*b) for b in BLOCKS])
def test_docs_block_runs(code: str, tmp_path: Path) -> None:
    script = tmp_path / "block.py"
    script.write_text(code)
    env = {**os.environ, "GLOG_minloglevel": "2", "MC_LOG_LEVEL": "ERROR"}
    proc = subprocess.run([sys.executable, str(script)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=TIMEOUT_S, check=False)
    assert proc.returncode == 0, (
        f"docs block failed (exit {proc.returncode}):\n{code}\n--- stdout\n"
        f"{proc.stdout[-3000:]}\n--- stderr\n{proc.stderr[-3000:]}")


LINK = re.compile(r"\]\((?P<target>[^)\s#]*)(?:#(?P<anchor>[^)\s]+))?\)")


def _slug(heading: str) -> str:
    """GitHub's anchor for a Markdown heading."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower().replace("`", ""))
    return text.replace(" ", "-")


def _anchors(page: Path) -> set[str]:
    return {_slug(h) for h in re.findall(r"^#+ (.*)$", page.read_text(), re.M)}


def test_every_relative_link_and_anchor_resolves() -> None:
    broken = []
    for page in PAGES:
        for m in LINK.finditer(page.read_text()):
            target, anchor = m["target"], m["anchor"]
            if target.startswith(("http://", "https://", "mailto:")):
                continue
            path = (page.parent / target).resolve() if target else page
            if not path.exists():
                broken.append(f"{page.relative_to(ROOT)}: {target} does not exist")
            elif anchor and path.suffix == ".md" and anchor not in _anchors(path):
                broken.append(f"{page.relative_to(ROOT)}: no heading #{anchor} in {target or page.name}")
    assert not broken, "\n".join(broken)
