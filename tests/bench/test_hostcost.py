"""The replay's host-cost view of a store: what it forwards, what it charges."""

from __future__ import annotations

import pytest
import torch

from layerlift.bench.hostcost import HostCostStore, HostRates, measure_rates
from layerlift.linker.memory_store import MemoryStore
from layerlift.overlap.link import EmulatedLink


def test_it_forwards_every_call_and_charges_the_missing_bytes() -> None:
    inner = MemoryStore()
    rates = HostRates(crc_s_per_byte=1e-12, copy_s_per_byte=1e-12)
    egress = EmulatedLink(1000.0, 0.0)
    store = HostCostStore(inner, token_scale=4, rates=rates, ingress_gbps=1000.0,
                          egress=egress)
    src = torch.arange(256, dtype=torch.uint8)
    dst = torch.zeros(256, dtype=torch.uint8)
    ps, pd = store.register(src), store.register(dst)
    store.put_parts(["a"], [[ps, ps + 100]], [[100, 28]])
    store.put(["b"], [ps], [64])
    assert store.exists(["a", "b", "c"]) == [True, True, False] == inner.exists(["a", "b", "c"])
    with store.open_session(["a"]):
        store.get_ranges(["a"], [[pd]], [[32]], [[50]])
    assert store.get(["b"], [pd + 64], [64]) == [True]
    assert torch.equal(dst[:32], src[50:82]) and torch.equal(dst[64:128], src[:64])
    got = store.charged.as_dict()
    assert got["put_bytes"] == 128 + 64 and got["read_bytes"] == 32 + 64
    assert got["put_host_s"] == pytest.approx(3 * 192 * 2e-12)  # (k - 1) of the bytes
    assert got["read_host_s"] == pytest.approx(3 * 96 * 2e-12)
    assert egress._busy_until > 0  # the puts booked the egress wire
    store.remove(["b"])
    assert inner.exists(["b"]) == [False]
    store.close()  # the shared store stays open
    assert inner.exists(["a"]) == [True]
    store.unregister(ps)
    store.unregister(pd)


def test_bad_arguments_and_measured_rates() -> None:
    with pytest.raises(ValueError, match="token_scale"):
        HostCostStore(MemoryStore(), token_scale=0, rates=HostRates(0, 0), ingress_gbps=None,
                      egress=None)
    with pytest.raises(ValueError, match="host rates"):
        HostRates(-1.0, 0.0)
    r = measure_rates(1 << 20, 64 << 10, repeats=1)
    assert r.crc_s_per_byte > 0 and r.copy_s_per_byte > 0
    with pytest.raises(ValueError, match="slice_bytes"):
        measure_rates(1024, 4096)
