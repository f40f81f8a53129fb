"""LayerLiftLinker's device path inside SGLang 0.5.23's real cache code: SGLang's own
pools (``SWAKVPool``, ``HybridReqToTokenPool``), wrapper and dynamic loader, with the
pools standing for a simulated device's memory (``SimDevice``, streams that really run
late; injected through ``LayerLiftLinker(device=...)``, see ``sglang_device_linker``).

The forward stand-in reads through the pools' accessors, whose ``wait_until`` makes
the forward's stream (the host's, here: SGLang passes no ``forward_stream`` on CPU)
wait on each layer's event. A cache on the simulated device restores byte for byte
what a host-path cache offloaded, and the other way round; a skipped event wait
(``DevicePath.wait`` patched out, the load stream held) reads wrong bytes that the byte
check catches while the batch still reports success. The SimDevice-only cases with all
four negative controls, and the CUDA ones, are ``tests/linker/test_sglang_device.py``.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from sglang_device_linker import SimDeviceLinker
from sglang_testkit import PAGE, SHAPE, assert_restored, tokens

from layerlift.hosts.sglang.device import DevicePath
from layerlift.linker.master import EmbeddedMaster
from layerlift.testing.sglang_harness import SGLangHost
from layerlift.testing.simdevice import SimDevice

pytestmark = [pytest.mark.sglang, pytest.mark.mooncake]


@pytest.fixture
def make_sim_host(mooncake_master: EmbeddedMaster,
                  mooncake_namespace: str) -> Iterator[Callable[..., tuple[SGLangHost, SimDevice]]]:
    """``make_sim_host(**extra)``: an SGLang cache whose LayerLift linker (made by
    SGLang's dynamic loader) runs on a new simulated device; closed after."""
    made: list[tuple[SGLangHost, SimDevice]] = []

    def make(**extra: Any) -> tuple[SGLangHost, SimDevice]:
        sim = SimDevice(seed=len(made) + 1, max_delay_s=0.001)
        settings = {"master_address": mooncake_master.master_address,
                    "namespace": mooncake_namespace, "model": "tiny-hybrid", "segment_mib": 32,
                    "staging_mib": 8, "timeout_s": 2.0, "load_timeout_s": 3.0, **extra}
        config = {"linker": "SimDeviceLinker", "linker_module_path": "sglang_device_linker",
                  "linker_extra_config": settings}
        SimDeviceLinker.device = sim
        try:
            host = SGLangHost(SHAPE, backend="dynamic", config=config)
        except BaseException:
            sim.close()
            raise
        finally:
            SimDeviceLinker.device = None
        made.append((host, sim))
        return host, sim

    yield make
    for host, sim in reversed(made):
        host.close()
        sim.close()


def test_a_cache_on_the_device_restores_what_a_host_cache_offloaded(
        make_host: Any, make_sim_host: Any) -> None:
    a = make_host()
    b, sim = make_sim_host(segment_mib=0)
    assert a.linker.path is None  # CPU pools: the host path
    assert b.linker.path is not None and b.linker.path.device is sim
    toks = tokens(6, seed=31)
    a.compute(toks, [3 * PAGE, 6 * PAGE])
    assert a.settle_offloads() >= 2
    r = b.restore([*toks, 7])
    assert (r.hit_tokens, r.loaded_tokens, r.ok) == (6 * PAGE, 6 * PAGE, True)
    assert_restored(b, r, toks)


def test_a_cache_on_the_device_offloads_what_its_forward_wrote(
        make_host: Any, make_sim_host: Any) -> None:
    a, sim = make_sim_host()
    b = make_host(segment_mib=0)
    assert a.linker.path is not None and a.linker.path.device is sim
    toks = tokens(6, seed=32)
    a.compute(toks, [3 * PAGE, 6 * PAGE])  # its offloads gather on the offload stream
    assert a.settle_offloads() >= 2
    r = b.restore([*toks, 7])
    assert (r.loaded_tokens, r.ok) == (6 * PAGE, True)
    assert_restored(b, r, toks)


def test_control_a_skipped_event_wait_inside_sglang_reads_wrong_bytes(
        make_host: Any, make_sim_host: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    a = make_host()
    b, sim = make_sim_host(segment_mib=0, depth=8)  # every layer's chunk issued while held
    toks = tokens(6, seed=33)
    a.compute(toks, [3 * PAGE, 6 * PAGE])
    assert a.settle_offloads() >= 2
    monkeypatch.setattr(DevicePath, "wait", lambda self, event: None)
    gate = threading.Event()
    sim.hold(gate)  # the load stream runs nothing until the forward read every layer
    try:
        adm = b.admit([*toks, 7])
        b.start_loads()
        b.forward(adm)
    finally:
        gate.set()
        sim.hold(None)
    b.finish([adm])
    assert adm.restore.ok, "the load itself landed: only the byte check can see the bug"
    with pytest.raises(AssertionError, match="restored other bytes"):
        assert_restored(b, adm.restore, toks)
