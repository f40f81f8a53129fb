"""A real model's layout through the default staging, on CPU pools.

32 layers (30 full attention, 1 sliding window, 1 Mamba), 8 KV heads of 128,
bf16, an 8192-token prompt: ~1 GiB of KV restored through the default 64 MiB
staging ring (the old adapter reserved staging for the whole request at once
and refused it), byte-exact. Marked ``slow``: minutes on a loaded 2-core box.
Its master keeps a read lease of 60 s: one batch's reads run in one Mooncake
read session, and a load longer than the master's ``--default_kv_lease_ttl``
fails with LEASE_EXPIRED (SGLang's own linker reads the same way).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest
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

REAL = HybridShape(kinds="F" * 15 + "S" + "F" * 15 + "M", page_size=64, window=128,
                   head_num=8, head_dim=128, kv_tokens=8192 + 256, mamba_slots=8)


def test_an_8k_prompt_of_a_32_layer_model_restores_exact_through_the_default_staging(
        make_host: Callable[..., SGLangHost]) -> None:
    staging = LinkerSettings().staging_mib  # the default
    a = make_host(shape=REAL, segment_mib=1400, staging_mib=staging)
    b = make_host(shape=REAL, segment_mib=0, staging_mib=staging)
    p = REAL.page_size
    toks = [7 + i for i in range(8192)]
    a.compute(toks, [8192])
    a.settle_offloads(timeout_s=300.0)
    kv = b.linker.layouts["kv"]
    total = 8192 // p * kv.object_bytes
    assert total > 8 * b.linker.ring.capacity, f"{total} bytes is not a real size"
    r = b.restore([*toks, 1])
    assert (r.hit_tokens, r.loaded_tokens, r.ok) == (8192, 8192, True)
    assert all(exact_or_zero(b, r, toks).values())
    assert b.linker.ring.idle()
