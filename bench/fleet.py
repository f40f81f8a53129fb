"""A fleet of serving instances on one store, for the replay.

Each instance is an :class:`~layerlift.engine.api.Engine` with its own device
pool and tree (and its own emulated NIC) behind its own
:class:`~layerlift.engine.serve.Server`; all of them share one store (the
in-process store, or the embedded Mooncake master) and one key namespace,
so what one instance offloaded another can restore. A router
(:mod:`layerlift.bench.routers`) sends each arrival to one instance.

Also here: the network profiles of the emulated link and how a simulated
setting's link, compute and token scale are put together
(:func:`simulated_setting`).

The event loop's timeliness is measured while the fleet runs: every
arrival's wake-up lag (actual minus scheduled arrival) and a probe that
sleeps ``PROBE_S`` in a loop (actual minus requested wake-up).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from layerlift.bench import trace as tr
from layerlift.bench.hostcost import HostCostStore
from layerlift.bench.routers import Router
from layerlift.engine.api import Engine
from layerlift.engine.config import EngineConfig
from layerlift.engine.model.base import Model
from layerlift.engine.serve import ServeConfig, Served, Server
from layerlift.linker.store_base import Store

__all__ = ["NETWORKS", "PROBE_S", "Instance", "Network", "run_fleet"]

PROBE_S = 0.005


@dataclass(frozen=True, slots=True)
class Network:
    """One NIC's sustained throughput (10**9 B/s) and one-way latency."""

    name: str
    gbps: float
    latency_us: float
    source: str

    def link(self, nics: int = 1, token_scale: int = 1) -> str:
        """The emulated link of an instance with ``nics`` NICs whose
        simulated tokens stand for ``token_scale`` real ones (its bytes are
        ``1/token_scale`` of the real ones, so the rate is too)."""
        if nics < 1 or token_scale < 1:
            raise ValueError(f"nics and token_scale must be >= 1, got {nics}, {token_scale}")
        return f"emulated:{self.gbps * nics / token_scale:.6g},{self.latency_us:g}"


NETWORKS: dict[str, Network] = {
    "rdma": Network("rdma", 45.0, 10.0,
                    "Mooncake Transfer Engine, one 400 Gbps RDMA NIC: 42-47 GB/s (Mooncake docs)"),
    "tcp100": Network("tcp100", 11.0, 30.0, "100 Gbit/s Ethernet, TCP: ~88 % of 12.5 GB/s"),
    "tcp25": Network("tcp25", 2.8, 50.0, "25 Gbit/s Ethernet, TCP: ~90 % of 3.125 GB/s"),
}


@dataclass(eq=False)
class Instance:
    """One engine and its server; ``queued_tokens`` / ``queued_s``: what the
    router sent it that is not answered yet (tokens, estimated seconds)."""

    index: int
    engine: Engine
    server: Server
    queued_tokens: int = 0
    queued_s: float = 0.0
    served: int = 0


@dataclass
class _Lag:
    arrivals: list[float] = field(default_factory=list)
    probe: list[float] = field(default_factory=list)


async def _probe(lag: _Lag, stop: asyncio.Event) -> None:
    loop = asyncio.get_running_loop()
    while not stop.is_set():
        want = loop.time() + PROBE_S
        await asyncio.sleep(PROBE_S)
        lag.probe.append(max(0.0, loop.time() - want))


async def _arrive(inst: Sequence[Instance], router: Router, req: tr.ScaledRequest, t0: float,
                  lag: _Lag) -> tuple[Served, int]:
    loop = asyncio.get_running_loop()
    due = t0 + req.arrival_s
    await asyncio.sleep(max(0.0, due - loop.time()))
    lag.arrivals.append(max(0.0, loop.time() - due))
    route = await router.route(req.tokens, inst)
    x = inst[route.instance]
    n = len(req.tokens)
    x.queued_tokens += n
    x.queued_s += route.est_s
    try:
        served = await x.server.submit(req.tokens)
    finally:
        x.queued_tokens -= n
        x.queued_s -= route.est_s
    x.served += 1
    return served, route.instance


def _pct(xs: Sequence[float], q: float) -> float:
    return float(np.percentile(np.asarray(xs, dtype=np.float64), q)) if xs else 0.0


async def run_fleet(model: Model, configs: Sequence[EngineConfig], store: Store,
                    serve_cfg: ServeConfig, router: Router,
                    reqs: Sequence[tr.ScaledRequest],
                    view: Callable[[Store], Store] | None = None
                    ) -> tuple[list[Served], dict[str, Any]]:
    """Replay ``reqs`` open-loop through one instance per config (all on
    ``store``; instance ``i`` sees it through ``view(store)`` when given, e.g.
    a :class:`~layerlift.bench.hostcost.HostCostStore` of its own NIC),
    routed by ``router``. Returns every request's :class:`Served` (in
    ``reqs`` order) and details: the instance of each request, requests per
    instance, whether prefetch ran, the event loop's lag (seconds: arrivals
    and probe, p50/p99/max) and the views' charged host work (summed)."""
    if not configs:
        raise ValueError("a fleet needs at least one instance")
    lag = _Lag()
    views: list[Store] = []
    async with contextlib.AsyncExitStack() as stack:
        inst = []
        for i, cfg in enumerate(configs):
            mine = view(store) if view is not None else store
            views.append(mine)
            eng = await stack.enter_async_context(Engine(model, cfg, store=mine))
            srv = await stack.enter_async_context(Server(eng, serve_cfg))
            inst.append(Instance(i, eng, srv))
        stop = asyncio.Event()
        probe = asyncio.create_task(_probe(lag, stop))
        try:
            t0 = asyncio.get_running_loop().time()
            out = await asyncio.gather(*(_arrive(inst, router, r, t0, lag) for r in reqs))
        finally:
            stop.set()
            await probe
        prefetch = all(x.server.prefetch_active for x in inst)
    charged: dict[str, float] = {}
    for v in views:
        for key, val in (v.charged.as_dict().items() if isinstance(v, HostCostStore) else ()):
            charged[key] = charged.get(key, 0.0) + val
    details = {
        "host_cost": charged,
        "instance_of": [i for _, i in out],
        "requests_per_instance": [x.served for x in inst],
        "prefetch_active": prefetch,
        "loop_lag": {
            "arrival_p50_s": _pct(lag.arrivals, 50), "arrival_p99_s": _pct(lag.arrivals, 99),
            "arrival_max_s": max(lag.arrivals, default=0.0),
            "probe_period_s": PROBE_S, "probe_p50_s": _pct(lag.probe, 50),
            "probe_p99_s": _pct(lag.probe, 99), "probe_max_s": max(lag.probe, default=0.0),
        },
    }
    return [s for s, _ in out], details
