"""A real model's layout through the default staging, on CPU pools.

32 layers (30 full attention, 1 sliding window, 1 Mamba), 8 KV heads of 128,
bf16 (a Llama-3-8B-like layout), an 8192-token prompt: ~1 GiB of KV, fifteen
times the default 64 MiB staging ring, restored through it byte-exact (the old
adapter reserved staging for the whole request at once and refused it), every
byte under its CRC-32C and every layer compared byte for byte. About 10 s on
the 2-core box (7 of them SGLang's import; ~3 s for the prompt's compute, the
offload, the restore and the check), ~27 s with three busy processes beside
it. It ran at 2048 tokens while the harness made its bytes with torch
(``torch.rand`` per page: 20 ms per 128 KiB page on a busy machine; 8192
tokens took 310 s there, 181 s of it the prompt's compute); the harness now
makes, reads and compares them in numpy (``sglang_harness.py``). Marked
``slow``.
Its master keeps a read lease of 60 s: one batch's reads run in one Mooncake
read session; the store renews a session whose read ended past the lease
(``test_sglang_truncated.py``), and the long lease keeps this test from
depending on that.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest
import torch
from sglang_testkit import exact_or_zero

from layerlift.hosts.sglang import LinkerSettings
from layerlift.linker.master import EmbeddedMaster
from layerlift.testing.sglang_harness import HybridShape, SGLangHost

pytestmark = [pytest.mark.sglang, pytest.mark.mooncake, pytest.mark.slow]


@pytest.fixture(scope="module")
def mooncake_master(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EmbeddedMaster]:
    log = tmp_path_factory.mktemp("mooncake-real-size") / "mooncake_master.log"
    with EmbeddedMaster(log_path=log, lease_ttl_ms=60_000) as master:
        yield master

TOKENS = 8192
REAL = HybridShape(kinds="F" * 15 + "S" + "F" * 15 + "M", page_size=64, window=128,
                   head_num=8, head_dim=128, kv_tokens=TOKENS + 256, mamba_slots=8)


@pytest.mark.parametrize("mode", ["staged", "in place"])
def test_a_32_layer_model_layout_restores_exact_through_the_default_staging(
        make_host: Callable[..., SGLangHost], mode: str) -> None:
    """Staged: through the default staging, fifteen times smaller than the
    restore. In place: read straight into the slots (its 128 KiB parts are
    below the default ``in_place_load_min_kib``, so the test lowers it)."""
    staging = LinkerSettings().staging_mib  # the default
    bounds = {"timeout_s": 30.0, "load_timeout_s": 120.0}  # ~1 GiB on a loaded 2-core box
    a = make_host(shape=REAL, segment_mib=TOKENS // 8 + 128, staging_mib=staging, **bounds)
    placed = {"in_place_load_min_kib": 128} if mode == "in place" else {}
    b = make_host(shape=REAL, segment_mib=0, staging_mib=staging, **bounds, **placed)
    p = REAL.page_size
    toks = [7 + i for i in range(TOKENS)]
    a.compute(toks, [TOKENS])
    a.settle_offloads(timeout_s=120.0)  # ~1 s quiet, ~2 s beside three busy processes
    kv = b.linker.layouts["kv"]
    total = TOKENS // p * kv.object_bytes
    assert total > 14 * b.linker.ring.capacity, f"{total} bytes does not exceed the staging"
    r = b.restore([*toks, 1])
    assert (r.hit_tokens, r.loaded_tokens, r.ok) == (TOKENS, TOKENS, True)
    assert b.linker.finished[-1].in_place == (mode == "in place")
    assert all(exact_or_zero(b, r, toks).values())
    assert b.linker.ring.idle()
    raw = r.layers[0][0].view(torch.uint8).reshape(-1)  # the check's negative control:
    raw[-1] ^= 1  # one flipped bit in the last byte of the restore must fail it
    with pytest.raises(AssertionError, match="layer 0 holds wrong bytes"):
        exact_or_zero(b, r, toks)
