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


# One bad value per field (several where a field has several rules): every
# field must refuse it at construction with a ValueError naming the field. A
# field added without a row here fails the coverage check below.
BAD: dict[type, dict[str, list[Any]]] = {
    EngineConfig: {
        "store": ["mooncake", "mooncake://h", "mooncake://h:0", "redis://h:1"],
        "policy": ["fastest"],
        "device": ["gpu", "cudax", "cuda:x"],
        "pool_bytes": [0, -1, "64", 1.5, True],
        "rank": [-1, 1, "0"],
        "world_size": [0, "1"],
        "namespace": ["", "a/b", 3],
        "metadata": ["etcd://h:1", "http://h/metadata"],
        "protocol": ["udp"],
        "rdma_devices": ["mlx5_0", "a b"],
        "segment_bytes": [-1, 8 << 20, 0, "1"],
        "client_buffer_bytes": [-1, "0"],
        "store_timeout_s": [0, -1.0, float("inf"), "1", True],
        "connect_timeout_s": [0, float("nan"), "5"],
        "max_in_flight": [0, 1.0],
        "stream_size": [0],
        "group_size": [0],
        "link": ["emulated:abc", "emulated:0", "emulated:", "mooncake", "bogus", 3],
        "layer_wait_timeout_s": [0, None],
        "offload": [1, "yes", None],
        "branch_checkpoints": [0],
        "restore": ["never"],
        "verify_restores": ["no"],
        "extra": [[], {1: 2}],
    },
    ServeConfig: {
        "max_batch_tokens": [0, "4096", 1.5, True],
        "max_batch_requests": [0],
        "max_queue": [0, None],
        "prefetch": [1, "yes"],
        "max_prompt_tokens": [0, 1.5, True],
        "vocab_size": [0, "512"],
    },
}
# Messages name the field, except where the field's value is the subject.
NAMED_AS = {"store": "store", "policy": "policy", "world_size": "world_size", "rank": "rank"}


@pytest.mark.parametrize("cls", [EngineConfig, ServeConfig], ids=lambda c: c.__name__)
def test_every_field_has_bad_values_to_refuse(cls: type) -> None:
    missing = sorted({f.name for f in dataclasses.fields(cls)} - set(BAD[cls]))
    assert not missing, f"{cls.__name__}: no bad value tried for {missing}"


CASES = [(cls, name, value) for cls, table in BAD.items()
         for name, values in table.items() for value in values]


@pytest.mark.parametrize("cls,name,value", CASES,
                         ids=[f"{c.__name__}.{n}={v!r}" for c, n, v in CASES])
def test_a_bad_value_is_refused_at_construction(cls: type, name: str, value: Any) -> None:
    with pytest.raises(ValueError) as exc:
        cls(**{name: value})
    message = str(exc.value)
    assert NAMED_AS.get(name, name) in message, f"{message!r} does not name {name}"
    assert "\n" not in message


def test_the_documented_example_runs() -> None:
    """The page's first code block: the error it prints is the real one."""
    text = PAGE.read_text()
    start = text.index("```python\n") + len("```python\n")
    code = text[start: text.index("```\n", start)]
    assert 'EngineConfig(policy="fastest")' in code
    exec(compile(code, str(PAGE), "exec"), {})
