"""Test support (never imported by production code).

* :mod:`.faults`: :class:`FaultyStore` wraps any store (a real Mooncake
  client included) and injects delays, failures and skipped reads;
* :mod:`.controls`: negative controls (:class:`SkipLayerWaits`) and a
  forward that fails or blocks on cue (:class:`FaultyModel`);
* :mod:`.invariants`: :func:`assert_quiescent`, the engine's invariants, and
  :func:`offload_and_drop` (store, empty and zero the device cache);
* :mod:`.kl`: the one KL helper (:func:`kl_divergence`) and its thresholds;
* :mod:`.netns`: hosts as network namespaces (:class:`NetnsHosts`) for
  multi-host tests and benchmarks.
"""

from __future__ import annotations

from layerlift.testing.controls import FaultyModel, InjectedForwardError, SkipLayerWaits
from layerlift.testing.faults import FaultyStore, LayerFault
from layerlift.testing.invariants import assert_quiescent, offload_and_drop
from layerlift.testing.kl import KL_EXACT, KL_WRONG, kl_divergence
from layerlift.testing.netns import NetnsHosts, netns_available

__all__ = [
    "KL_EXACT",
    "KL_WRONG",
    "FaultyModel",
    "FaultyStore",
    "InjectedForwardError",
    "LayerFault",
    "NetnsHosts",
    "SkipLayerWaits",
    "assert_quiescent",
    "kl_divergence",
    "netns_available",
    "offload_and_drop",
]
