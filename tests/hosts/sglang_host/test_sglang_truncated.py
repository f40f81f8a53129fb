"""Objects a load cannot read as laid out, inside SGLang's real wrapper, on a
real mooncake_master.

A truncated object is quarantined like a corrupt one, so the prefix is not
poisoned for good.

The staged load reads each object's slices and its footer (whole, with the
first slice); past the end of a truncated object the store answers with the object's size
(``StoreObjectSize``), and the load treats it as a checksum mismatch: the
linker's ``on_corrupt`` quarantines the key, the offload thread removes it
from the store before it writes the page again, and lookups stop offering it.

A load longer than the master's read lease (this suite's master: 1 s) but
within ``load_timeout_s`` lands exact: the store renews the batch's read
session when a read ends past the lease.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import pytest
from sglang_testkit import (
    PAGE,
    RawStore,
    exact_or_zero,
    full_key,
    hook_store,
    on_device,
    reseal,
    tokens,
)

from layerlift.testing.sglang_harness import SGLangHost

pytestmark = [pytest.mark.sglang, pytest.mark.mooncake]

Make = Callable[..., SGLangHost]


@pytest.mark.parametrize("keep", ["half-page", "no-footer"])
def test_a_truncated_object_is_removed_and_the_next_lookup_misses(
        make_host: Make, raw: RawStore, mooncake_namespace: str, keep: str) -> None:
    toks = tokens(4, seed=90)
    scratch = make_host(namespace=f"{mooncake_namespace}-scratch")
    scratch.compute(toks, [4 * PAGE])
    scratch.settle_offloads()
    layout = scratch.linker.layouts["kv"]
    a, b = make_host(), make_host(segment_mib=0)
    key = full_key(a, toks, 1)
    whole = reseal(raw.get(full_key(scratch, toks, 1), layout.object_bytes), layout, key)
    cut = layout.page_bytes // 2 if keep == "half-page" else layout.page_bytes
    raw.plant(key, whole[:cut])  # a's own offload then finds the key taken and leaves it
    a.compute(toks, [4 * PAGE])
    a.settle_offloads()

    first = b.restore([*toks, 1])
    assert first.hit_tokens == 4 * PAGE and not first.ok  # SGLang aborts the loading request
    layers = exact_or_zero(b, first, toks)  # no wrong byte was used: exact or zero
    assert not all(layers.values())
    assert on_device(b, toks) == 0  # nothing of the failed load entered the tree
    quarantine = b.linker.quarantine
    assert quarantine.holds([key]) == [True] or quarantine.removed >= 1, \
        "the truncated object's key was not quarantined"

    # The next request for that prefix is not offered the truncated page.
    second = b.restore([*toks, 2])
    assert second.hit_tokens < 2 * PAGE, f"the truncated page was offered: {second.hit_tokens}"
    if second.hit_tokens:
        assert second.ok

    # The quarantine wakes the idle offload thread: the object is removed
    # (once the read's lease ran out) without waiting for another offload, so
    # other caches stop being offered it.
    deadline = time.monotonic() + 15.0
    while len(quarantine) or quarantine.removed < 1:
        assert time.monotonic() < deadline, \
            "the truncated object was not removed while no offload ran"
        time.sleep(0.02)
    assert raw.store.exists([key]) == [False], "the quarantined object is still in the store"

    # Recomputing repairs the prefix: the offload writes the page again.
    b.compute(toks, [4 * PAGE])
    b.settle_offloads()
    assert raw.get(key, layout.object_bytes) == whole, "the page was not written again whole"
    c = make_host(segment_mib=0)  # a cache that never saw the truncated object
    good = c.restore([*toks, 4])
    assert good.hit_tokens == 4 * PAGE and good.ok
    assert all(exact_or_zero(c, good, toks).values())


def test_a_load_longer_than_the_read_lease_lands_exact(make_host: Make) -> None:
    toks = tokens(4, seed=91)
    a = make_host()
    a.compute(toks, [4 * PAGE])
    a.settle_offloads()
    b = make_host(segment_mib=0, timeout_s=2.0, load_timeout_s=8.0)
    lease_s = 1.0  # conftest's master
    lock = threading.Lock()
    first: list[float] = []

    def late(keys: list[str], offsets: object) -> None:
        """The first read goes at once; every later one starts two leases
        after it (a slow link: the batch's session has outlived its lease)."""
        with lock:
            if not first:
                first.append(time.monotonic())
                return
            start = first[0] + 2 * lease_s
        while time.monotonic() < start:  # a TTL: only time ends a lease
            time.sleep(0.02)

    hook_store(b, get_ranges=late)
    r = b.restore([*toks, 1])
    assert first, "the load read nothing"
    assert r.hit_tokens == 4 * PAGE and r.ok, "a load past the read lease failed"
    assert all(exact_or_zero(b, r, toks).values())
