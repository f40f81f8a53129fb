"""Key schema: namespace/fingerprint.format/component/rank/pagehash."""

from __future__ import annotations

import pytest

from layerlift.linker.integrity import OBJECT_FORMAT
from layerlift.linker.keys import KeySchema

H1 = bytes.fromhex("00ff10ab")
H2 = bytes.fromhex("deadbeef")


def test_key_format() -> None:
    schema = KeySchema("prod", "llama-bf16-ps64", rank=1)
    assert schema.key("full", H1) == f"prod/llama-bf16-ps64.{OBJECT_FORMAT}/full/1/00ff10ab"
    assert schema.keys("mamba", [H1, H2]) == [
        f"prod/llama-bf16-ps64.{OBJECT_FORMAT}/mamba/1/00ff10ab",
        f"prod/llama-bf16-ps64.{OBJECT_FORMAT}/mamba/1/deadbeef",
    ]
    assert schema.key("swa", H1).startswith(schema.prefix)


def test_every_field_separates_keys() -> None:
    base = KeySchema("ns", "fp1", 0)
    variants = [KeySchema("ns2", "fp1", 0), KeySchema("ns", "fp2", 0), KeySchema("ns", "fp1", 1),
                KeySchema("ns", "fp1", 0, object_format="l1")]
    keys = {base.key("full", H1), base.key("swa", H1), base.key("full", H2)}
    keys |= {v.key("full", H1) for v in variants}
    assert len(keys) == 7


@pytest.mark.parametrize(
    ("namespace", "fingerprint", "rank"),
    [("a/b", "fp", 0), ("", "fp", 0), ("ns", "f p", 0), ("ns", "fp", -1), ("ns", "fp", True)],
)
def test_invalid_schema(namespace: str, fingerprint: str, rank: int) -> None:
    with pytest.raises(ValueError):
        KeySchema(namespace, fingerprint, rank)


@pytest.mark.parametrize(("component", "page_hash"), [("fu/ll", H1), ("full", b""), ("", H1)])
def test_invalid_key_inputs(component: str, page_hash: bytes) -> None:
    with pytest.raises(ValueError):
        KeySchema("ns", "fp", 0).key(component, page_hash)
