"""The options of ``layerlift bench ttft``: the parser, the link list, and
the grid the defaults give (``--quick`` or the full one).

Every bad value is refused while parsing, in one line naming the option and
what it accepts (:mod:`layerlift.bench.args`); what depends on the model
(a prefix must be a whole number of its checkpoint intervals) is checked
by :func:`resolve_grid` with the same one-line error.
"""

from __future__ import annotations

import argparse
from typing import Any

from layerlift.bench.args import BenchParser, device, int_at_least, int_list, name_list
from layerlift.bench.netns_link import emulated_twin, is_netns, rate_gbps
from layerlift.overlap.link import parse_link
from layerlift.pools.spec import ModelSpec

__all__ = ["DEFAULT_EMULATED", "FULL", "QUICK", "build_parser", "links", "resolve_grid"]

# Chosen on the 2-core CPU machine (torch 1 thread) for preset "small", suffix 64, batch 1:
# the suffix forward takes ~130-150 ms there, the restore of P = 512 / 1024 / 2048 tokens
# moves ~8 / 13 / 21 MB, so 0.1 GB/s puts Σa at ~0.6x / 1x / 1.5x of Σc (within 2x).
# On a GPU the forward is far faster: pass a faster link there (e.g. emulated:25,5).
DEFAULT_EMULATED = "emulated:0.1,10"
QUICK: dict[str, Any] = dict(preset=["small"], prefix=[512, 1024, 2048], suffix=[64], batch=[1],
                             repeats=3, warmup=1)
# ~9 min on the 2-core box (recompute of 4096 x 2 tokens dominates); medium, longer
# suffixes and batch 4 are available through the options.
FULL: dict[str, Any] = dict(preset=["small"], prefix=[512, 1024, 2048, 4096], suffix=[64],
                            batch=[1, 2], repeats=5, warmup=1)
LINK_FORMS = ("'mooncake', 'emulated:GBPS[,LATENCY_US]' (a modelled NIC of GBPS gigabytes per "
              "second and LATENCY_US microseconds, e.g. emulated:0.1,10) or 'netns:RATE' "
              "(e.g. netns:1gbit), comma-separated")


def links(text: str) -> list[str]:
    """'mooncake,emulated:2,10,emulated:1' -> ['mooncake', 'emulated:2,10', 'emulated:1'].

    ``netns:RATE`` runs the engines on a namespace host behind a link throttled to RATE
    (bench/netns_link.py); ``cluster:HOST:PORT`` (internal: what runs on that host)
    connects to an existing master whose storage node holds the segment. Raises
    ``argparse.ArgumentTypeError`` naming the bad part and the accepted forms.
    """
    out: list[str] = []
    for part in [x for x in text.replace(" ", "").split(",") if x]:
        if part.startswith(("cluster:", "emulated:", "netns:")) or part == "mooncake":
            out.append(part)
        elif out and out[-1].startswith("emulated:") and out[-1].count(",") == 0:
            out[-1] += "," + part  # the latency of the previous emulated link
        else:
            raise argparse.ArgumentTypeError(f"unknown link {part!r}; use {LINK_FORMS}")
    if not out:
        raise argparse.ArgumentTypeError(f"no link given; use {LINK_FORMS}")
    for link in out:
        try:
            if is_netns(link):
                rate_gbps(link)
            elif not link.startswith("cluster:"):
                parse_link(link)
        except ValueError:
            raise argparse.ArgumentTypeError(f"bad link {link!r}; use {LINK_FORMS}") from None
    return out


def _is_model(name: str) -> bool:
    return name.startswith("hf:") and len(name) > 3


def build_parser() -> argparse.ArgumentParser:
    full, quick = FULL, QUICK

    def both(key: str) -> str:
        join = (lambda v: ",".join(map(str, v))) if isinstance(full[key], list) else str
        return f"default: {join(full[key])}; with --quick: {join(quick[key])}"

    presets = ModelSpec.preset_names()
    ap = BenchParser("layerlift bench ttft",
                     "Time to first token (TTFT: from the prefill call to the next token's "
                     "distribution) of recompute, barrier restore and overlap restore, p50/p90.")
    ap.add_argument("--preset", type=name_list(presets), default=None, metavar="NAMES",
                    help=f"model preset(s), comma-separated, from {', '.join(presets)} "
                         f"({both('preset')})")
    ap.add_argument("--model", type=name_list(presets, ", hf:<arch> or hf:<dir>", _is_model),
                    default=None, metavar="NAMES",
                    help="model(s) instead of --preset: a preset, hf:<arch> (a tiny "
                         "transformers config: hf:lara_mini, hf:nemotron_h, hf:gpt_oss, "
                         "hf:lfm2) or hf:<dir>")
    ap.add_argument("--prefix", type=int_list(1, "512,1024"), default=None, metavar="TOKENS",
                    help=f"prefix lengths in tokens, restored ({both('prefix')})")
    ap.add_argument("--suffix", type=int_list(1, "64"), default=None, metavar="TOKENS",
                    help=f"suffix lengths in tokens, computed ({both('suffix')})")
    ap.add_argument("--batch", type=int_list(1, "1,2"), default=None, metavar="SIZES",
                    help=f"batch sizes, prompts per prefill call ({both('batch')})")
    ap.add_argument("--repeats", type=int_at_least(1), default=None,
                    help=f"measured repeats per point ({both('repeats')})")
    ap.add_argument("--warmup", type=int_at_least(0), default=None,
                    help=f"warm-up repeats per point, not measured ({both('warmup')})")
    ap.add_argument("--links", type=links, default=None, metavar="LINKS",
                    help=f"link modes (default: mooncake,{DEFAULT_EMULATED}): mooncake is real "
                         "Mooncake TCP over loopback; emulated:GBPS[,LATENCY_US] a modelled NIC "
                         "of GBPS gigabytes/s and LATENCY_US microseconds over an in-memory "
                         "store; netns:RATE (e.g. netns:1gbit, needs root) runs the engines on a "
                         "namespace host behind a throttled link to a master and a storage "
                         "node, and adds the emulated link at the same rate beside it")
    ap.add_argument("--device", type=device, default="cpu", help="cpu, cuda or cuda:N")
    ap.add_argument("--quick", action="store_true",
                    help="the small grid (small preset, P 512/1024/2048, S 64, B 1, 3 repeats)")
    ap.add_argument("--seed", type=int_at_least(0), default=0, help="prompt seed")
    ap.add_argument("--threads", type=int_at_least(1), default=None,
                    help="torch CPU threads (default: 1 on cpu, leaving a core to the link "
                         "and keeping timings stable on a shared 2-core machine)")
    ap.add_argument("--json", default=None, metavar="PATH", help="write the results as JSON here")
    ap.add_argument("--markdown", default=None, metavar="PATH",
                    help="write a Markdown report here")
    ap.add_argument("--plot", default=None, metavar="PATH",
                    help="write a PNG plot here (needs matplotlib: the dev extra)")
    ap.add_argument("--no-progress", action="store_true", help="no progress line on stderr")
    return ap


def resolve_grid(args: argparse.Namespace, ap: argparse.ArgumentParser) -> None:
    """Fill the grid's unset options from ``--quick`` or the full grid, add
    each netns link's emulated twin, and check each prefix against each
    model's checkpoint interval (``ap.error``: one line, exit status 2)."""
    from layerlift.bench.models import build_model

    base = QUICK if args.quick else FULL
    if args.model is not None:
        args.preset = args.model
    for key in ("preset", "prefix", "suffix", "batch", "repeats", "warmup"):
        if getattr(args, key) is None:
            setattr(args, key, list(base[key]) if isinstance(base[key], list) else base[key])
    if args.links is None:
        args.links = ["mooncake", DEFAULT_EMULATED]
    for link in [x for x in args.links if is_netns(x)]:  # the emulated link at the same rate
        twin = emulated_twin(link)
        if twin not in args.links:
            args.links.insert(args.links.index(link) + 1, twin)
    for p in args.preset:
        try:
            spec = build_model(p).spec
        except (ValueError, OSError, ImportError) as exc:
            ap.error(f"argument --model: {exc}")
        for n in args.prefix:
            if n % spec.track_interval:
                ap.error(f"argument --prefix: {n} is not a multiple of {p}'s checkpoint "
                         f"interval ({spec.track_interval} tokens), so it cannot be restored "
                         f"whole; use e.g. {spec.track_interval * 4}")
