"""EmulatedLink timing and parse_link."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest

from layerlift.overlap import EmulatedLink, parse_link

MIB = 1 << 20


def test_one_mib_at_one_gbps_takes_about_a_millisecond() -> None:
    src, dst = np.ones(MIB, np.uint8), np.zeros(MIB, np.uint8)
    link = EmulatedLink(1.0)
    fetch = link.wrap(lambda: np.copyto(dst, src), MIB)
    t0 = time.perf_counter()
    fetch()
    elapsed = time.perf_counter() - t0
    assert elapsed >= MIB / 1e9 * 0.99
    assert dst.all()  # the real copy happened


def test_concurrent_transfers_share_the_wire() -> None:
    link = EmulatedLink(1.0, latency_us=100)
    fetches = [link.wrap(lambda: None, MIB) for _ in range(2)]
    threads = [threading.Thread(target=f) for f in fetches]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert time.perf_counter() - t0 >= 2 * MIB / 1e9 + 100e-6
    assert link.transfer_time(MIB) == pytest.approx(MIB / 1e9 + 100e-6)


def test_failed_copy_raises_without_sleeping() -> None:
    def broken() -> None:
        raise OSError("read failed")

    with pytest.raises(OSError):
        EmulatedLink(1e-6).wrap(broken, MIB)()  # would sleep ~17 minutes if it slept


@pytest.mark.parametrize(
    ("spec", "gbps", "latency"),
    [("emulated:25,5", 25.0, 5.0), ("emulated:1.5", 1.5, 0.0), (" Emulated:100,0 ", 100.0, 0.0)],
)
def test_parse_emulated(spec: str, gbps: float, latency: float) -> None:
    link = parse_link(spec)
    assert link is not None and (link.gbps, link.latency_us) == (gbps, latency)


def test_parse_mooncake_is_the_real_path() -> None:
    assert parse_link("mooncake") is None


@pytest.mark.parametrize(
    "spec",
    ["", "rdma", "emulated:", "emulated:fast", "emulated:1,2,3", "emulated:0", "emulated:5,-1"],
)
def test_parse_rejects(spec: str) -> None:
    with pytest.raises(ValueError):
        parse_link(spec)
