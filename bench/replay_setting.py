"""What a replay runs on: the model (the reference model of ``--preset`` on
this CPU, or a :class:`~layerlift.engine.model.simulated.SimulatedModel`),
its compute profile and token scale, the link the store-backed policies use,
the priors the restore-aware router prices with, and each instance's view of
the shared store.

``--arch reference`` is the reference model's own layout with the
``cpu-measured`` profile (``--calibration``, fitted by ``bench/calibrate.py``
when missing): the fidelity check against real mode. ``--arch NAME`` is a
published architecture at token scale ``512 / --block-tokens`` (one trace
block, one page) on ``--device`` (``--gpus`` per instance) with
``--network``'s NIC per GPU, scaled as ``engine/model/architectures.py``
describes. With ``--host-costs charged`` each instance sees the store through
a :class:`~layerlift.bench.hostcost.HostCostStore`: the host work of the
bytes the token scale leaves out, and puts on the NIC's egress.
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from layerlift.bench import trace as tr
from layerlift.bench.fleet import NETWORKS
from layerlift.bench.hostcost import HostCostStore, HostRates
from layerlift.engine.costmodel import CostPriors
from layerlift.engine.model import HybridModel
from layerlift.engine.model.architectures import ARCHITECTURES, simulated_spec
from layerlift.engine.model.base import Model
from layerlift.engine.model.compute_model import DEVICES, ComputeModel, RooflineCompute, SeqWork
from layerlift.engine.model.simulated import SimulatedModel
from layerlift.linker.store_base import Store
from layerlift.overlap.link import EmulatedLink, parse_link
from layerlift.pools.spec import ModelSpec

__all__ = ["Setting", "build_setting", "store_view"]


@dataclass(frozen=True, slots=True)
class Setting:
    """The model a replay runs and what it says about it: ``mode`` real or
    simulated, the compute profile, the token scale, the link the
    store-backed policies use, and the priors the restore-aware router
    prices with."""

    model: Model
    mode: str
    profile: str
    token_scale: int
    links: list[str]
    priors: CostPriors
    info: dict[str, Any]


def _priors(compute: ComputeModel | None, model: Model, link: str | None,
            typical_tokens: int) -> CostPriors:
    """Cost-model priors of a setting: the link's rate and latency, and the
    compute model's seconds per token for one prompt of ``typical_tokens``."""
    parsed = parse_link(link) if link else None
    bw = parsed.gbps * 1e9 if parsed else 1e9
    lat = parsed.latency_us * 1e-6 if parsed else 50e-6
    if compute is None:
        return CostPriors(bw, lat)
    k = getattr(model, "token_scale", 1)
    n = max(1, typical_tokens)
    per_tok = sum(compute.layer_seconds(model.spec.kinds, [SeqWork(0, n * k)])) / n
    return CostPriors(bw, lat, per_tok)


def build_setting(args: argparse.Namespace) -> Setting:
    """Real (the reference model of ``--preset``) or simulated (``--arch``)."""
    if args.model == "real":
        model: Model = HybridModel(ModelSpec.preset(args.preset), seed=0)
        info: dict[str, Any] = {"arch": f"reference:{args.preset}",
                                "profile": "real (this CPU)"}
        return Setting(model, "real", "real", 1, list(args.links),
                       _priors(None, model, args.links[0], 0), info)
    if args.arch == "reference":
        from layerlift.bench import calibrate

        path = Path(args.calibration)
        compute: ComputeModel = calibrate.load(path)
        spec = ModelSpec.preset(args.preset)
        model = SimulatedModel(spec, compute, token_scale=1, vocab_size=spec.dims.vocab_size,
                               name=f"reference-{args.preset}")
        info = {"arch": f"reference:{args.preset}", "profile": compute.name,
                "calibration": str(path)}
        return Setting(model, "simulated", compute.name, 1, list(args.links),
                       _priors(compute, model, args.links[0], 256), info)
    arch = ARCHITECTURES[args.arch]
    if tr.TRACE_BLOCK_TOKENS % args.block_tokens:
        raise ValueError(f"--block-tokens must divide {tr.TRACE_BLOCK_TOKENS} "
                         "for a simulated architecture")
    k = tr.TRACE_BLOCK_TOKENS // args.block_tokens
    page = args.block_tokens
    if arch.window:  # the sliding window in pages of simulated tokens
        page = math.gcd(page, max(1, arch.window // k))
    spec = simulated_spec(arch.name, token_scale=k, page_size=page,
                          track_interval=args.track_blocks * args.block_tokens)
    gpus = args.gpus or arch.default_gpus
    if args.device not in DEVICES:
        raise ValueError(f"--device {args.device} is not a GPU profile "
                         f"({', '.join(DEVICES)}); cpu-measured needs --arch reference")
    device = DEVICES[args.device].with_gpus(gpus)
    compute = RooflineCompute(arch, device)
    model = SimulatedModel(spec, compute, token_scale=k, vocab_size=32000, name=arch.name)
    net = NETWORKS[args.network]
    link = net.link(nics=gpus, token_scale=k)
    info = {"arch": arch.name, "arch_source": arch.source, "profile": compute.name,
            "device_source": device.source, "util": device.util, "mem_util": device.mem_util,
            "gpus": gpus, "network": net.name, "network_gbps_per_nic": net.gbps,
            "network_source": net.source, "page_tokens": page, "swa_window": spec.swa_window,
            "track_interval": spec.track_interval}
    return Setting(model, "simulated", compute.name, k, [link],
                   _priors(compute, model, link, 14000 // k), info)


def store_view(setting: Setting, link: str | None,
          rates: HostRates | None) -> Callable[[Store], Store] | None:
    """Each instance's view of the shared store: the host work of the
    bytes the token scale leaves out, and puts on the NIC's egress
    (``bench/hostcost.py``); None when host costs are not charged."""
    if rates is None:
        return None
    parsed = parse_link(link) if link else None

    def view(store: Store) -> Store:
        egress = EmulatedLink(parsed.gbps, parsed.latency_us) if parsed else None
        return HostCostStore(store, token_scale=setting.token_scale, rates=rates,
                             ingress_gbps=parsed.gbps if parsed else None, egress=egress)
    return view
