"""LayerLift inside SGLang beside SGLang's own Mooncake linker (issue 26), one run.

    layerlift bench sglang [--json PATH] [--markdown PATH] [--plot PATH] [--repeats N]
        [--layout small|real] [--pages 64,128] [--prompt-tokens N] [--compute-ms C]
        [--ordered-reads auto|on|off] [--no-faults] [--links loopback,netns:1gbit]

The same harness (``layerlift.testing.sglang_harness``: SGLang 0.5.23's real
``UnifiedRadixCache``, ``SWAKVPool`` and ``HybridReqToTokenPool`` on CPU; with
``--layout small`` a 12-layer F S M S M F model, 8 KV heads x 64, 1024-token
prompts and 2 ms of compute a layer; with ``--layout real`` a real model's
layout, 32 layers (30 full attention, one sliding window, one Mamba: the
harness's pools need one of each), 8 KV heads x 128, bf16 (128 KiB a token),
8192-token prompts and, per layer, a Llama-3-8B layer's prefill time at the
prompt's length on one H100 (the roofline of ``engine/model/compute_model.py``:
9.3 ms at 8192 tokens)) runs with each linker,
built by SGLang's own factory: ``--unified-cache-external-linker-backend
dynamic`` with ``LayerLiftLinker``, and ``mooncake`` (SGLang's
``MooncakeDirectLinker``), on one embedded ``mooncake_master`` (loopback TCP).
A producer cache computes and offloads a prompt, a consumer cache restores it
through match, load back, layer-wise loading and a forward stand-in that reads
every layer through the pools' accessors and then spends ``--compute-ms`` per
layer (a sleep: it costs no CPU, so the two linkers' transfers get the cores).

1. ``timing``: per link, per page size, per linker, ``--repeats`` restores
   (distinct prompts, the linkers interleaved): when each layer's wait
   returned (from the forward's start) and the forward's total; medians with
   95 % bootstrap intervals; every restore checked byte-exact against what
   was offloaded. Links (``--links``): ``loopback`` (the master and the
   producer's segment in this process, TCP over loopback) and
   ``netns:RATE[+DELAYms]``: the master and a storage node holding the only
   segment (``layerlift store-node``) on namespace hosts of their own, the
   caches (producer and consumer, segment 0) in a child process on a third
   host whose link the kernel throttles to RATE (``tbf``, both ends) and, with
   ``+DELAYms``, delays by DELAY each way (``netem``; where the kernel has no
   netem the row says so). Every restored byte crosses that link. Namespaces
   need root; where they are unavailable the row says why.
2. ``faults`` (64-token pages): a ranged read that lands one flipped byte in
   layer 5's slice (the fault injected in each linker's own read call), a
   master stopped (SIGSTOP) just before the layer-wise load, and the storage
   node holding the only segment (a ``layerlift store-node`` process) killed
   (SIGKILL) just before it: what each linker lets through (verdict, layers
   holding wrong bytes, whether the request's output would be used) and how
   long until the batch's verdict (a forward still waiting after 15 s is
   released by resuming the master: that linker's block is unbounded, the
   15 s is only when the benchmark gave up waiting).

The machine's load average is recorded: the figures come from a shared 2-core
box and are noisy.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from layerlift.bench.args import BenchParser, float_above, int_at_least, int_list
from layerlift.bench.output import add_output_options, write_outputs
from layerlift.bench.sglang_faults import fault_points
from layerlift.bench.sglang_setup import (
    LAYOUTS,
    LEASE_S,
    LINKERS,
    NETNS_LEASE_S,
    NETNS_SEGMENT,
    SEGMENT_CAP_MIB,
    SETTLE_S,
    Sweeper,
    kv_bytes,
    layer_kv_bytes,
    links_arg,
    make_pair,
    parse_link,
    prefill_ms_per_layer,
    random_prompt,
    segment_mib,
    shape_for,
)
from layerlift.bench.stats import percentile_ci
from layerlift.linker.master import EmbeddedMaster
from layerlift.testing.sglang_harness import Restore, SGLangHost, same_bytes

# ``--ordered-reads``: LayerLift's ``ordered_reads`` setting.
ORDERED_READS: dict[str, bool | str] = {"on": True, "off": False, "auto": "auto"}


def _exact(host: SGLangHost, r: Restore, tokens: list[int]) -> list[bool]:
    """Per layer: the bytes the forward read equal, byte for byte, what the
    producer computed (one layer's expected bytes at a time)."""
    done = tokens[: r.loaded_tokens]
    return [all(same_bytes(g, e) for g, e in
                zip(r.layers[layer], host.expected_layer(done, layer), strict=True))
            for layer in sorted(r.layers)]


def _ci(values: list[float]) -> dict[str, float]:
    """Median and its 95 % bootstrap interval over the repeats."""
    med, lo, hi = percentile_ci([values], 50)
    return {"median": med, "lo": lo, "hi": hi}


def _one_restore(pair: tuple[SGLangHost, SGLangHost], tokens: list[int], page: int,
                 compute_s: float) -> tuple[Restore, bool]:
    """The producer computes and offloads ``tokens``, the consumer restores
    them: the restore and whether every layer it read is exact. RuntimeError
    when the offloads did not end within ``SETTLE_S``. Both caches are
    flushed afterwards (the next prompt gets the whole pools)."""
    producer, consumer = pair
    n = len(tokens)
    producer.compute(tokens, [n // 2 // page * page, n])
    producer.settle_offloads(timeout_s=SETTLE_S)
    r = consumer.restore([*tokens, 1], compute_s=compute_s)
    ok = r.ok and r.loaded_tokens == n and all(_exact(consumer, r, tokens))
    r.layers.clear()  # the restored bytes (checked): a real layout's are 1 GiB
    for host in pair:
        host.flush_cache()
    return r, ok


def timing_point(page: int, repeats: int, prompt_tokens: int, compute_s: float,
                 master: str | dict[str, str], rng: random.Random, link: str = "loopback",
                 layout: str = "small", lease_s: float = 0.0, **pair: Any) -> dict[str, Any]:
    """One (link, page size) point; ``master``: the master's address, or each
    linker's own (its read lease ``lease_s``: what a restore read is removed
    once it ended); ``pair``: ``make_pair``'s options (segment, address, bounds).
    Round -1 warms up (first touches of pools and segments): checked, not
    timed. A linker whose offloads never end is reported and left out."""
    shape = shape_for(page, layout, prompt_tokens)
    pair.setdefault("segment_mib", segment_mib(shape, prompt_tokens))
    masters = master if isinstance(master, dict) else {name: master for name in LINKERS}
    pairs = {name: make_pair(name, shape, masters[name], **pair) for name in LINKERS}
    sweepers = {name: Sweeper(masters[name], pair.get("local", "127.0.0.1"), lease_s)
                for name in LINKERS}
    runs: dict[str, list[Restore]] = {name: [] for name in LINKERS}
    exact = {name: 0 for name in LINKERS}
    warm_wrong = {name: 0 for name in LINKERS}
    unsettled: dict[str, str] = {}  # a linker whose offload never ended: why
    n = prompt_tokens // page * page
    try:
        for rep in range(-1, repeats):
            for name in (x for x in LINKERS if x not in unsettled):
                try:
                    r, ok = _one_restore(pairs[name], random_prompt(rng, n), page, compute_s)
                except RuntimeError as exc:
                    unsettled[name] = f"{exc} {SETTLE_S:g} s after the prompt's inserts"
                    continue
                if rep < 0:
                    warm_wrong[name] += not ok
                else:
                    exact[name] += ok
                    runs[name].append(r)
                sweepers[name].sweep()  # the store keeps what is still leased
        # LayerLift's batches whose reads took turns (``ordered_reads``), the warm-up's too.
        in_turn = {name: [b.read_order is not None for b in getattr(consumer.linker, "finished", [])]
                   for name, (_, consumer) in pairs.items()}
    finally:
        for producer, consumer in pairs.values():
            consumer.close()
            producer.close()
        for sweeper in sweepers.values():
            sweeper.close()
    out: dict[str, Any] = {"link": link, "page_tokens": page, "prompt_tokens": n,
                           "layout": layout, "kv_bytes": kv_bytes(shape, n),
                           "layers": len(shape.kinds),
                           "attention_layer_bytes": layer_kv_bytes(shape, n),
                           "linkers": {}}
    ours, theirs = ([r.forward_s for r in runs[name]] for name in LINKERS)
    if len(ours) == len(theirs) == repeats:
        out["ratio"] = _ci([a / b for a, b in zip(ours, theirs, strict=True)])  # paired by repeat
    for name, rs in runs.items():
        out["linkers"][name] = _linker_row(rs, exact[name], warm_wrong[name],
                                           unsettled.get(name, ""), len(shape.kinds))
        if in_turn[name]:
            out["linkers"][name]["batches_in_turn"] = f"{sum(in_turn[name])}/{len(in_turn[name])}"
    return out


def _linker_row(rs: list[Restore], exact: int, warm_wrong: int, why_not: str,
                layers: int) -> dict[str, Any]:
    """One linker's figures at one point (only ``not_measured`` without restores)."""
    if not rs:
        return {"exact": "0/0", "not_measured": why_not}
    return {"not_measured": why_not, "exact": f"{exact}/{len(rs)}",
            "warmup_not_exact": warm_wrong, "forward_s": _ci([r.forward_s for r in rs]),
            "forward_all_s": [round(r.forward_s, 5) for r in rs],
            "layer_ready_s": [_ci([r.wait_s[i] for r in rs])["median"] for i in range(layers)]}


def render(record: dict[str, Any]) -> str:
    # A record made before --links (one loopback row kind) keeps its old table.
    linked = "links" in record
    head = "| link " if linked else ""
    layout = (f" ({record['layout']} layout, {record['prompt_tokens']}-token prompts)"
              if "layout" in record else "")
    lines = [f"### SGLang: LayerLiftLinker beside MooncakeDirectLinker{layout}", "",
             f"{head}| page | linker | exact | forward total (s), median [95% CI] |"
             " layer 0 ready (s) | last layer ready (s) | layerlift / mooncake, paired |",
             "| --- " * (8 if linked else 7) + "|"]
    for point in record["timing"]:
        cell = f"| {point.get('link', 'loopback')} " if linked else ""
        ratio = point.get("ratio")
        for name, lk in point["linkers"].items():
            if "forward_s" not in lk:
                lines.append(f"{cell}| {point['page_tokens']} | {name} | — | not measured: "
                             f"{lk['not_measured']} | — | — | — |")
                continue
            f = lk["forward_s"]
            paired = (f"{ratio['median']:.3f} [{ratio['lo']:.3f}, {ratio['hi']:.3f}]"
                      if ratio and name == LINKERS[0] else "")
            lines.append(f"{cell}| {point['page_tokens']} | {name} | {lk['exact']} | "
                         f"{f['median']:.4f} [{f['lo']:.4f}, {f['hi']:.4f}] | "
                         f"{lk['layer_ready_s'][0]:.4f} | {lk['layer_ready_s'][-1]:.4f} | "
                         f"{paired} |")
    for skipped in record.get("links_unavailable", []):
        lines.append(f"| {skipped['link']} | — | — | — | not measured: {skipped['why']} "
                     "| — | — | — |")
    if record.get("faults"):
        lines += ["", "| linker | fault | hit tokens | load reported failed | layers with wrong"
                  " bytes | layers zeroed | output used | verdict after (s) |",
                  "| --- | --- | --- | --- | --- | --- | --- | --- |"]
        for f in record["faults"]:
            took = (f"{f['verdict_s']} (the forward was still blocked at {f['hung_past_s']:g} s,"
                    " when the benchmark resumed the master: the block is unbounded)"
                    if f["hung_past_s"] else f["verdict_s"])
            lines.append(f"| {f['linker']} | {f['fault']} | {f['hit_tokens']} | "
                         f"{f['load_reported_failed']} | "
                         f"{f['layers_with_wrong_bytes']} | {f['layers_zeroed']} | "
                         f"{f['output_used']} | {took} |")
    meta = record["meta"]
    lines += ["", f"`{meta['command']}` — load average {meta['loadavg']}, {meta['cpus']} CPUs, "
              f"compute stand-in {record['compute_ms']} ms/layer."]
    return "\n".join(lines)


def plot(record: dict[str, Any], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    points = record["timing"]
    fig, axes = plt.subplots(1, len(points), figsize=(5 * len(points), 3.5), squeeze=False)
    for ax, point in zip(axes[0], points, strict=True):
        for name, lk in point["linkers"].items():
            ax.plot(range(point["layers"]), lk["layer_ready_s"], marker="o", label=name)
        link = f"{point['link']}, " if "link" in point else ""
        ax.set_title(f"{link}{point['page_tokens']}-token pages")
        ax.set_xlabel("layer")
        ax.set_ylabel("wait returned (s from forward start)")
        ax.legend()
    fig.tight_layout()
    fig.savefig(path)


def build_parser() -> argparse.ArgumentParser:
    ap = BenchParser("layerlift bench sglang", (__doc__ or "").splitlines()[0])
    add_output_options(ap)
    ap.add_argument("--repeats", type=int_at_least(5), default=7, help="restores per point")
    ap.add_argument("--pages", type=int_list(16, "64,128"), default=[64, 128],
                    help="page sizes in tokens")
    ap.add_argument("--layout", choices=LAYOUTS, default="small",
                    help="the cache's layout: small (12 layers, 8 KV heads x 64) or real "
                         "(32 layers, 8 KV heads x 128, bf16: 128 KiB a token)")
    ap.add_argument("--prompt-tokens", type=int_at_least(256), default=None,
                    help="tokens restored per request (default: 1024 small, 8192 real)")
    ap.add_argument("--compute-ms", type=float_above(-1e-9), default=None,
                    help="the forward stand-in's compute per layer, a sleep (default: 2 small; "
                         "real: a Llama-3-8B layer's prefill of the prompt on one H100, "
                         "9.3 ms at 8192 tokens)")
    ap.add_argument("--ordered-reads", choices=sorted(ORDERED_READS), default=None,
                    help="LayerLift's ordered_reads setting: its load's reads one layer at a "
                         "time, lowest first (on), as they come (off), or decided by the last "
                         "batch (auto, the linker's default)")
    ap.add_argument("--no-faults", action="store_true", help="skip the fault cases")
    ap.add_argument("--links", type=links_arg, default=["loopback", "netns:1gbit"],
                    help="links of the timing rows: loopback, netns:RATE[+DELAYms]")
    ap.add_argument("--child-master", help=argparse.SUPPRESS)  # a netns link's engine host
    ap.add_argument("--child-json", help=argparse.SUPPRESS)
    return ap


def _child(args: argparse.Namespace) -> int:
    """On a netns link's engine host: the timing points against the cluster's
    master (both caches segment 0: the storage node holds every object)."""
    from layerlift.engine.stores import route_source

    master = args.child_master
    rng = random.Random(26)
    pair: dict[str, Any] = {"segment_mib": 0, "local": route_source(master), "bounds": (10.0, 30.0),
                            "extra": _extra(args)}
    lease_s = NETNS_LEASE_S if args.layout == "real" else 0.0
    timing = [timing_point(p, args.repeats, args.prompt_tokens, args.compute_ms / 1e3, master,
                           rng, layout=args.layout, lease_s=lease_s, **pair) for p in args.pages]
    Path(args.child_json).write_text(json.dumps({"timing": timing}))
    return 0


def _extra(args: argparse.Namespace) -> dict[str, Any]:
    """LayerLift's settings the command line changes."""
    return {} if args.ordered_reads is None else \
        {"ordered_reads": ORDERED_READS[args.ordered_reads]}


def _netem(hosts: Any, label: str, rate: str, delay_ms: float) -> None:
    """Delay ``label``'s link by ``delay_ms`` each way under its ``rate``
    (netem, with the token bucket beneath it), at both ends."""
    host = hosts[label]
    for netns, dev in ((host.netns, host.iface), (hosts.switch, host.port)):
        for step in (["root", "handle", "1:", "netem", "delay", f"{delay_ms:g}ms"],
                     ["parent", "1:", "handle", "2:", "tbf", "rate", rate, "burst", "128kb",
                      "latency", "50ms"]):
            verb = "replace" if step[0] == "root" else "add"
            cmd = ["ip", "netns", "exec", netns, "tc", "qdisc", verb, "dev", dev, *step]
            done = subprocess.run(cmd, capture_output=True, text=True, check=False)
            if done.returncode != 0:
                raise RuntimeError(f"this kernel refused a {delay_ms:g} ms delay "
                                   f"({' '.join(cmd[4:])}: {done.stderr.strip()}); is "
                                   "sch_netem available?")


def netns_points(link: str, args: argparse.Namespace) -> list[dict[str, Any]]:
    """The timing points over ``netns:RATE[+DELAYms]`` (see the module docstring)."""
    from layerlift.bench.netns_link import engine_host_json, netns_cluster

    _, rate, delay_ms = parse_link(link)
    assert rate is not None
    with (tempfile.TemporaryDirectory(prefix="layerlift-sglang-netns-") as tmp,
          netns_cluster(rate, netns_segment(args), tmp) as (hosts, master)):
        if delay_ms:
            _netem(hosts, "engine", rate, delay_ms)
        out = Path(tmp) / "points.json"
        argv = [sys.executable, "-m", "layerlift.cli", "bench", "sglang", "--no-faults",
                "--repeats", str(args.repeats), "--pages", ",".join(map(str, args.pages)),
                "--layout", args.layout, "--prompt-tokens", str(args.prompt_tokens),
                "--compute-ms", str(args.compute_ms),
                *(["--ordered-reads", args.ordered_reads] if args.ordered_reads else []),
                "--child-master", master, "--child-json", str(out)]
        points: list[dict[str, Any]] = engine_host_json(hosts, argv, tmp, out)["timing"]
    for p in points:
        p["link"] = link
    return points


def netns_segment(args: argparse.Namespace) -> int:
    """Bytes of the storage node's segment on a namespace link: every
    producer's objects live there (two prompts', under 2 GiB; each restore's
    objects are swept once their read lease ended)."""
    shape = shape_for(max(args.pages), args.layout, args.prompt_tokens)
    return max(NETNS_SEGMENT, min(SEGMENT_CAP_MIB << 20,
                                  2 * kv_bytes(shape, args.prompt_tokens) + (128 << 20)))


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.prompt_tokens is None:
        args.prompt_tokens = 8192 if args.layout == "real" else 1024
    if args.compute_ms is None:
        args.compute_ms = (round(prefill_ms_per_layer(args.prompt_tokens), 3)
                           if args.layout == "real" else 2.0)
    os.environ.setdefault("MC_LOG_LEVEL", "ERROR")
    if args.child_master:
        return _child(args)
    rng = random.Random(26)
    timing: list[dict[str, Any]] = []
    unavailable: list[dict[str, str]] = []
    faults: list[dict[str, Any]] = []
    # A 2 s read lease: over loopback a real layout's restore reads for ~1 s,
    # and what a restore read can be swept 2 s later. On loopback each linker
    # has a master of its own: its producer's segment is the store's only one
    # (SGLang's puts into another client's segment in this process failed).
    lease_ms = int(LEASE_S * 1e3)
    with (EmbeddedMaster(http_metadata=False, lease_ttl_ms=lease_ms) as master,
          EmbeddedMaster(http_metadata=False, lease_ttl_ms=lease_ms) as second):
        if "loopback" in args.links:
            own = {LINKERS[0]: master.master_address, LINKERS[1]: second.master_address}
            timing += [timing_point(p, args.repeats, args.prompt_tokens, args.compute_ms / 1e3,
                                    own, rng, layout=args.layout, lease_s=LEASE_S,
                                    extra=_extra(args))
                       for p in args.pages]
        faults = [] if args.no_faults else fault_points(master, rng)
    for link in (x for x in args.links if x != "loopback"):
        from layerlift.testing.netns import netns_available

        ok, why = netns_available()
        if not ok:
            unavailable.append({"link": link, "why": why})
            continue
        try:
            timing += netns_points(link, args)
        except RuntimeError as exc:
            unavailable.append({"link": link, "why": str(exc)})
    out = {"what": "LayerLiftLinker vs SGLang's MooncakeDirectLinker in SGLang 0.5.23's cache, "
                   "CPU pools; loopback: one embedded mooncake_master on loopback TCP; "
                   "netns: a master and a storage node across a throttled namespace link",
           "repeats": args.repeats, "compute_ms": args.compute_ms, "links": args.links,
           "layerlift_settings": _extra(args),
           "layout": args.layout, "prompt_tokens": args.prompt_tokens,
           "compute_source": ("a Llama-3-8B layer's prefill of the prompt on one H100 "
                              "(roofline)" if args.layout == "real" else "a fixed stand-in"),
           "timing": timing, "links_unavailable": unavailable, "faults": faults,
           "meta": {"loadavg": [round(x, 2) for x in os.getloadavg()], "cpus": os.cpu_count()}}
    print(render(write_outputs("sglang", out, args, argv, render, plot)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
