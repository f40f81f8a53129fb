"""docs/guide/configuration.md lists every EngineConfig and ServeConfig field
once, with its real default: adding, renaming or re-defaulting a field without
the docs fails here."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path
from typing import Any

import pytest

from layerlift import EngineConfig
from layerlift.engine.serve import ServeConfig

PAGE = Path(__file__).resolve().parents[1] / "docs" / "guide" / "configuration.md"
ROW = re.compile(r"^\| `(?P<name>\w+)` \| `(?P<default>[^`]*)` \|", re.M)


def _section(title: str) -> str:
    text = PAGE.read_text()
    start = text.index(f"## {title}\n")
    nxt = text.find("\n## ", start + 1)
    return text[start: None if nxt < 0 else nxt]


def _default(f: dataclasses.Field[Any]) -> Any:
    if f.default is not dataclasses.MISSING:
        return f.default
    assert f.default_factory is not dataclasses.MISSING, f.name
    return f.default_factory()


@pytest.mark.parametrize("cls", [EngineConfig, ServeConfig], ids=lambda c: c.__name__)
def test_every_field_is_documented_with_its_default(cls: type) -> None:
    rows = [(m["name"], m["default"]) for m in ROW.finditer(_section(cls.__name__))]
    names = [n for n, _ in rows]
    fields = {f.name: f for f in dataclasses.fields(cls)}
    assert len(names) == len(set(names)), f"a field is listed twice: {names}"
    missing, extra = sorted(set(fields) - set(names)), sorted(set(names) - set(fields))
    assert not missing and not extra, (
        f"{PAGE.name} ## {cls.__name__}: undocumented {missing}, not fields {extra}")
    for name, text in rows:
        assert eval(text) == _default(fields[name]), (
            f"{cls.__name__}.{name}: the docs say {text}, the default is "
            f"{_default(fields[name])!r}")
