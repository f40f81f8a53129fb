"""Restores across hosts, and the faults that happen between hosts.

The master, the storage node (`layerlift store-node`) and each engine run on
their own namespace host; the engines contribute no memory (`segment_bytes=0`),
so every restored byte crosses the switch over Mooncake TCP. Every result is
compared with the cold computation of the same prompt (KL <= KL_EXACT).
"""

from __future__ import annotations

import time
from typing import Any

import pytest
from netns_cluster import TIMEOUT_S, Agent, Cluster, assert_exact, prompt

pytestmark = pytest.mark.netns

LENGTH = 1024
# Slow enough that the layers after layer 0 are still on the wire when the
# test injects its fault (the whole restore takes ~1 s at this rate).
SLOW = {"engine": "5mbit"}


def _cold_then_stored(agent: Agent, tokens: list[int]) -> dict[str, Any]:
    """Compute `tokens` cold, wait until the store holds them, empty the device."""
    cold = agent.prefill(tokens)
    assert cold["restored"] == 0 and cold["computed"] == len(tokens)
    report = agent.ask(op="offloads")
    assert report["objects"] > 0 and report["failed"] == 0
    agent.ask(op="drop")
    return cold


def _restore_until(agent: Agent, tokens: list[int], cold: dict[str, Any], tries: int) -> int:
    """Prefill (dropping the device cache first) until a restore succeeds; every
    result must be exact. Returns the attempts it took; fails after `tries`."""
    for attempt in range(1, tries + 1):
        agent.ask(op="offloads")  # until they end, offloads keep their pages on the device
        agent.ask(op="drop")
        result = agent.prefill(tokens)
        assert_exact(result, cold)
        if result["restored"] > 0:
            return attempt
    raise AssertionError(f"no restore within {tries} prefills")


def test_restore_across_hosts_is_exact(cluster: Cluster) -> None:
    agent = cluster.engine()
    tokens = prompt(LENGTH)
    cold = _cold_then_stored(agent, tokens)
    restored = agent.prefill(tokens)
    assert restored["restored"] >= LENGTH - 128 and not restored["recomputed"]
    assert_exact(restored, cold)


def test_two_engines_on_two_hosts_share_one_cache(cluster: Cluster) -> None:
    first = cluster.engine("engine")
    second = cluster.engine("engine2")
    tokens = prompt(LENGTH, salt=1)
    cold = _cold_then_stored(first, tokens)
    shared = second.prefill(tokens)  # second never computed this prompt
    assert shared["restored"] >= LENGTH - 128
    assert_exact(shared, cold)


@pytest.mark.parametrize("cluster", [SLOW], indirect=True)
def test_storage_node_killed_mid_restore(cluster: Cluster) -> None:
    agent = cluster.engine()
    tokens = prompt(LENGTH, salt=2)
    cold = _cold_then_stored(agent, tokens)
    agent.send(op="staged", tokens=tokens)
    assert agent.read()["event"] == "landed"  # layer 0 landed, the rest is on the wire
    assert cluster.store is not None
    cluster.hosts.kill(cluster.store)
    agent.send(op="go")
    result = agent.read()
    assert result["recomputed"] and result["restored"] == 0, result
    assert_exact(result, cold)
    other = prompt(LENGTH // 2, salt=3)  # the engine keeps serving
    served = agent.prefill(other)
    assert served["computed"] == len(other)


@pytest.mark.parametrize("cluster", [SLOW], indirect=True)
def test_engine_link_down_mid_restore(cluster: Cluster) -> None:
    agent = cluster.engine()
    tokens = prompt(LENGTH, salt=4)
    cold = _cold_then_stored(agent, tokens)
    agent.send(op="staged", tokens=tokens)
    assert agent.read()["event"] == "landed"
    cluster.hosts.link_down("engine")
    start = time.monotonic()
    agent.send(op="go")
    result = agent.read()
    elapsed = time.monotonic() - start
    assert result["recomputed"], result
    assert_exact(result, cold)
    assert elapsed < 3 * TIMEOUT_S, f"the lost link cost {elapsed:.1f} s (timeout {TIMEOUT_S} s)"
    cluster.hosts.link_up("engine")
    _restore_until(agent, tokens, cold, tries=5)


def test_master_killed_and_restarted(cluster: Cluster) -> None:
    agent = cluster.engine()
    tokens = prompt(LENGTH, salt=5)
    cold = _cold_then_stored(agent, tokens)
    assert cluster.master is not None
    cluster.hosts.kill(cluster.master)
    agent.ask(op="drop")
    meanwhile = agent.prefill(tokens)  # no master: compute
    assert meanwhile["restored"] == 0 and meanwhile["computed"] == LENGTH
    assert_exact(meanwhile, cold)
    cluster.start_master()
    # The restarted master knows no objects: prefills compute and offload
    # again, and restore once the storage node's segment is mounted again
    # The storage node mounts its segment again within seconds (it pings the
    # master every second and reconnects with a back-off).
    _restore_until(agent, tokens, cold, tries=60)
