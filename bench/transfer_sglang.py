"""SGLang's two linkers as rows of the transfer benchmark, beside raw Mooncake calls, one run.

    .venv-sglang/bin/layerlift bench transfer-sglang [--tokens 8192] [--page-sizes 64,128]
        [--repeats 5] [--netns RATE ...] [--no-loopback] [--json PATH] [--markdown PATH]

``layerlift bench transfer`` times the engine's transfer against raw
Mooncake; this is the same for the two linkers inside SGLang 0.5.23's real
cache (``layerlift.testing.sglang_harness``, the layout of ``bench sglang
--layout real``: 32 layers, 30 of them full attention, one sliding window of
128 tokens, one Mamba; 8 KV heads x 128, bf16), with no forward compute:
how fast each moves one prompt between SGLang's pools and the store.

Each repeat runs three units, their order rotated per repeat:

* ``raw``: ``raw ranged d4`` (``bench transfer``'s: one ``get_ranges`` per
  layer of a 32-layer page object per page, four layers in flight, inside
  one read session, no checksum), ``raw ranged d4 + check`` (the same read
  after one call of every footer, each layer's slices checked against them
  by the thread that read them: LayerLift's check and nothing else) and
  ``raw put`` (one ``put`` of every object), the same payload;
* each linker (``LayerLiftLinker``; SGLang's ``MooncakeDirectLinker``, built
  by SGLang's factory as ``bench sglang`` builds them): a producer cache
  writes the prompt's KV into its pools (not timed) and inserts it; its
  **offload** is timed from the insert until the scheduler's poll (every
  2 ms) finds the last put committed. A consumer cache matches the prompt
  and loads it back; its **load** is timed from ``ready_to_load_host_cache``
  until every layer's wait returned (the pools' accessors, as a forward
  calls them, without reading) and ``finish_external_linker_loads`` gave its
  verdict. Then, not timed, every byte that landed is compared with what the
  producer wrote: a restore that is not exact ends the benchmark.

GB/s: a load's payload is what landed in the consumer's pools (every
full-attention layer's K+V of the prompt, the sliding-window layer's last
window, the Mamba state); an offload's is the prompt's K+V in the 31
attention layers (the Mamba state and each linker's metadata not counted);
the raw rows' their page bytes. ``/ raw`` is the median of the per-repeat
ratios of a load to ``raw ranged d4`` and of an offload to ``raw put``;
``/ MooncakeDirectLinker`` of LayerLift's GB/s to SGLang's own, per repeat.
``cores``: the process's CPU time over the wall time of the step;
``machine``: the cores busy on the whole machine meanwhile (every process
and the kernel's work: a namespace link's storage node, veth and ``tbf``).
On loopback the raw client and each linker have a master of their own, and
the store's segment is in this process: the producer's, as SGLang's
instances contribute theirs (``bench sglang``'s set-up), so a linker's puts
land in its own segment by memcpy and the raw put is the segment holder's
own put beside them; the consumer (no segment) reads over TCP, as the raw
reader does. (With the segment on a storage node instead, SGLang's 1 GiB of
puts from ``MooncakeDirectLinker`` stalled on loopback until Mooncake's 60 s
transfer timeout, TRANSFER_FAIL.) ``--netns RATE``: one master and a storage
node holding the only segment on namespace hosts of their own, the caches and
the raw client (segment 0 each) on a third host behind a ``tbf`` link of
RATE: every put and read crosses that link.
"""

from __future__ import annotations

import argparse
import gc
import random
import sys
import tempfile
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, ExitStack, contextmanager, nullcontext
from functools import partial
from pathlib import Path
from typing import Any

from layerlift.bench.args import BenchParser
from layerlift.bench.netns_link import add_link_options
from layerlift.bench.output import add_output_options
from layerlift.bench.sglang_setup import (
    LEASE_S,
    LINKERS,
    NETNS_LEASE_S,
    SEGMENT_CAP_MIB,
    SETTLE_S,
    Sweeper,
    kv_bytes,
    make_pair,
    random_prompt,
    segment_mib,
    shape_for,
)
from layerlift.bench.transfer import Bench, Clock, Layout, Step
from layerlift.bench.transfer_hosts import NotMeasured, Rounds, add_case_options, run_host_bench
from layerlift.bench.transfer_report import (
    RAW_CHECKED,
    RAW_LOAD,
    RAW_PUT,
    host_rows_table,
    plot_kinds,
)
from layerlift.linker.master import EmbeddedMaster
from layerlift.linker.mooncake_config import MooncakeConfig
from layerlift.linker.mooncake_store import MooncakeStore
from layerlift.linker.store_base import Store
from layerlift.testing.sglang_harness import HybridShape, SGLangHost, same_bytes

__all__ = ["build_parser", "main", "render_table"]

NAMES = {"layerlift": "LayerLiftLinker", "sglang-mooncake": "MooncakeDirectLinker"}


def _require(ok: object, what: str) -> None:
    if not ok:
        raise RuntimeError(f"bench transfer-sglang: {what}")


class OffloadsStalled(NotMeasured):
    """A linker's offloads of a prompt did not end within ``SETTLE_S``: there
    is nothing of its to restore, and its rows of the case are not measured."""


class Case:
    """One prompt length and page size: the raw client's objects, one
    producer/consumer pair of caches per linker and what empties their store."""

    def __init__(self, tokens: int, page: int, raw_store: Store, masters: dict[str, str], *,
                 local: str, lease_s: float, shared_master: bool, put_store: Store,
                 producer_segment: int | None, timeout_s: float) -> None:
        self.shape = shape_for(page, "real", tokens)
        self.n = tokens // page * page
        self.shared_master = shared_master
        self.rng = random.Random(42 + page)
        self.offload_bytes = kv_bytes(self.shape, self.n)
        self.load_bytes = 0  # what one restore landed: counted by the first check
        self.put_store = put_store
        with ExitStack() as stack:
            self.raw = Bench(raw_store, _raw_layout(self.shape), self.n, timeout_s)
            stack.callback(self.raw.close)
            if shared_master:
                self.raw.remove_objects()  # put again by each raw unit
            if put_store is not raw_store:
                put_store.register(self.raw.src)
                stack.callback(put_store.unregister, int(self.raw.src.data_ptr()))
            seg = segment_mib(self.shape, self.n) if producer_segment is None else producer_segment
            bounds = (timeout_s, timeout_s) if shared_master else (2.0, 5.0)
            self.pairs: dict[str, tuple[SGLangHost, SGLangHost]] = {}
            self.sweepers: dict[str, Sweeper] = {}
            for name in LINKERS:
                pair = make_pair(name, self.shape, masters[name], seg, local, bounds)
                pair[0].clock = Clock  # the offload's clock starts at the insert
                stack.callback(pair[0].close)
                stack.callback(pair[1].close)
                self.pairs[name] = pair
                sweeper = Sweeper(masters[name], local, lease_s)
                stack.callback(sweeper.close)
                self.sweepers[name] = sweeper
            self._closing = stack.pop_all()

    def close(self) -> None:
        self._closing.close()

    def raw_unit(self) -> dict[str, Step]:
        """The raw rows (``Bench.raw_rows``), the put from the segment holder."""
        if not self.shared_master:
            return self.raw.raw_rows(self.put_store)
        # One segment for every row (under 2 GiB, as SGLang's puts need): the
        # raw objects live only for their read.
        self.raw.reput()
        return self.raw.raw_rows(self.put_store, before_put=self.raw.remove_objects)

    def linker_unit(self, name: str) -> dict[str, Step]:
        """One offload and one restore of a new prompt through ``name``'s pair."""
        producer, consumer = self.pairs[name]
        tokens = random_prompt(self.rng, self.n)
        try:
            producer.compute(tokens, [self.n])
            offload = producer.insert_clock  # a Clock (producer.clock), read at the insert
            try:
                producer.settle_offloads(timeout_s=SETTLE_S)
            except RuntimeError as exc:  # the harness's "N offload(s) still pending"
                raise OffloadsStalled(f"{NAMES[name]}'s offloads of a prompt did not end "
                                      f"within {SETTLE_S:g} s ({exc})") from exc
            off = offload.stop(self.offload_bytes)
            adm = consumer.admit([*tokens, 1])
            _require(adm.restore.loaded_tokens == self.n,
                     f"{NAMES[name]} loads {adm.restore.loaded_tokens} of {self.n} tokens")
            clock = Clock()
            consumer.start_loads()
            consumer.forward(adm, read=False)
            consumer.finish([adm])
            lap = clock.lap()  # its bytes are counted by the check, after
            _require(adm.restore.ok, f"{NAMES[name]}'s load failed")
            self.load_bytes = self._check(consumer, adm.restore.tail, adm.restore.mamba_slot,
                                          tokens, name)
            load = lap(self.load_bytes)
        finally:
            for host in (producer, consumer):
                host.flush_cache()
            self.sweepers[name].sweep()  # the store keeps what is still leased
        return {name: load, f"{name} offload": off}

    def _check(self, consumer: SGLangHost, tail: Any, slot: int | None, tokens: list[int],
               name: str) -> int:
        """Every layer the consumer loaded equals what the producer wrote; the bytes compared."""
        if tail is None or slot is None:
            raise RuntimeError(f"bench transfer-sglang: {NAMES[name]} loaded no slots")
        total = 0
        for layer in range(len(self.shape.kinds)):
            got = consumer.loaded_layer(tail, int(slot), layer)
            want = consumer.expected_layer(tokens, layer)
            _require(all(same_bytes(g, w) for g, w in zip(got, want, strict=True)),
                     f"{NAMES[name]} loaded wrong bytes into layer {layer}")
            total += sum(int(g.numel() * g.element_size()) for g in got)
        return total


def measure(case: Case, repeats: int) -> dict[str, Any]:
    """Round -1 warms up (checked, not timed); then ``repeats`` rounds of the
    rotated units. A linker whose offloads stall (:class:`OffloadsStalled`)
    leaves the case: its rows are ``not measured`` with the reason, in every
    round (ratios stay paired over the same rounds)."""
    units: dict[str, Callable[[], dict[str, Step]]] = {
        "raw": case.raw_unit, **{name: partial(case.linker_unit, name) for name in LINKERS}}
    rounds = Rounds(units, repeats)
    ratio, stalled = rounds.ratio, rounds.failed
    measured = [n for n in LINKERS if n not in stalled]
    loads = {RAW_LOAD: RAW_LOAD, RAW_CHECKED: RAW_CHECKED, **{NAMES[n]: n for n in measured}}
    offloads = {RAW_PUT: RAW_PUT, **{NAMES[n]: f"{n} offload" for n in measured}}

    out: dict[str, Any] = {
        "tokens": case.n, "page": case.shape.page_size, "repeats": repeats,
        "load_bytes": case.load_bytes, "offload_bytes": case.offload_bytes,
        "raw_bytes": case.raw.payload,
        **rounds.spreads("loads", loads, RAW_LOAD),
        **rounds.spreads("offloads", offloads, RAW_PUT),
        "not measured": {NAMES[n]: why for n, why in stalled.items()},
    }  # fmt: skip
    if not stalled:
        ours, theirs = LINKERS
        out["LayerLift / MooncakeDirectLinker"] = {
            "load": ratio(ours, theirs), "offload": ratio(f"{ours} offload", f"{theirs} offload")}
    return out


def run_cases(raw_store: Store, args: argparse.Namespace,
              linker_masters: Callable[[], AbstractContextManager[dict[str, str]]],
              **where: Any) -> dict[str, Any]:
    """Every case; ``linker_masters()``: the linkers' master addresses for one case."""
    out: dict[str, Any] = {}
    for tokens in args.tokens:
        for page in args.page_sizes:
            label = f"{tokens} tokens, page {page}"
            print(f"  {label}", flush=True)
            with linker_masters() as masters:
                case = Case(tokens, page, raw_store, masters, timeout_s=args.timeout, **where)
                try:
                    out[label] = measure(case, args.repeats)
                finally:
                    case.close()
                    del case
                    gc.collect()  # the hosts' store clients leave before their masters stop
    return out


def _raw_layout(shape: HybridShape) -> Layout:
    """The raw rows' objects: every layer of a page, bf16, as ``bench transfer`` lays them."""
    return Layout(len(shape.kinds), shape.head_num, shape.head_dim, 2, shape.page_size)


def _raw_segment(args: argparse.Namespace) -> int:
    """The raw client's segment: its objects and a raw put in flight of the
    biggest case, with slack."""
    biggest = max(_raw_layout(shape_for(page, "real", tokens)).object_bytes * (tokens // page)
                  for tokens in args.tokens for page in args.page_sizes)
    return int(2.5 * biggest) + (256 << 20)


@contextmanager
def _own_masters(lease_ms: int) -> Iterator[dict[str, str]]:
    """A master of its own for each linker, new for each case: with the
    masters of a case before (whose producers held the segments) SGLang's
    puts at the next page size failed (TRANSFER_FAIL)."""
    with ExitStack() as stack:
        yield {name: stack.enter_context(EmbeddedMaster(http_metadata=False,
                                                        lease_ttl_ms=lease_ms)).master_address
               for name in LINKERS}


def run_loopback(args: argparse.Namespace) -> dict[str, Any]:
    lease_ms = int(LEASE_S * 1e3)
    with ExitStack() as stack:
        raw_master = stack.enter_context(EmbeddedMaster(lease_ttl_ms=5000, http_metadata=False))
        writer = stack.enter_context(MooncakeStore(raw_master.config(
            global_segment_size=_raw_segment(args), timeout_s=args.timeout)))
        reader = stack.enter_context(MooncakeStore(raw_master.config(
            global_segment_size=0, local_buffer_size=16 << 20, timeout_s=args.timeout)))
        return run_cases(reader, args, partial(_own_masters, lease_ms), local="127.0.0.1",
                         lease_s=LEASE_S, shared_master=False, put_store=writer,
                         producer_segment=None)


def run_cluster(master: str, args: argparse.Namespace) -> dict[str, Any]:
    """On a namespace link's engine host: every store is a client of the one master."""
    from layerlift.engine.stores import route_source

    local = route_source(master)
    client = MooncakeStore(MooncakeConfig(
        master_address=master, local_hostname=local, global_segment_size=0,
        local_buffer_size=16 << 20, timeout_s=args.timeout))
    with client:
        return run_cases(client, args, lambda: nullcontext({name: master for name in LINKERS}),
                         local=local, lease_s=NETNS_LEASE_S, shared_master=True,
                         put_store=client, producer_segment=0)


def run_netns(rate: str, args: argparse.Namespace) -> dict[str, Any]:
    from layerlift.bench.netns_link import engine_host_json, netns_cluster

    segment = SEGMENT_CAP_MIB << 20
    with tempfile.TemporaryDirectory(prefix="layerlift-transfer-sglang-") as tmp, netns_cluster(
            rate, segment, tmp) as (hosts, master):
        out = Path(tmp) / "cases.json"
        child = [sys.executable, "-m", "layerlift.cli", "bench", "transfer-sglang",
                 "--tokens", ",".join(map(str, args.tokens)),
                 "--page-sizes", ",".join(map(str, args.page_sizes)),
                 "--repeats", str(args.repeats), "--timeout", str(args.timeout),
                 "--cluster", master, "--json", str(out)]
        cases: dict[str, Any] = engine_host_json(hosts, child, tmp, out)["cases"]
        return cases


def render_table(record: dict[str, Any]) -> str:
    """The results page's tables: loads, then offloads, per link and case."""

    def paired(c: dict[str, Any], kind: str, row: str) -> dict[str, float] | None:
        ratios = c.get("LayerLift / MooncakeDirectLinker")
        return ratios[kind[:-1]] if ratios and row == "LayerLiftLinker" else None

    return host_rows_table(record, host="MooncakeDirectLinker", paired=paired,
                           not_measured_in=lambda kind, row: True)


def plot_record(record: dict[str, Any], path: str) -> None:
    """Median GB/s of every row, loads and offloads, one group per link and case."""
    plot_kinds(record, path, ["loads", "offloads"], lambda kind: f"SGLang's linkers: {kind}")


def build_parser() -> argparse.ArgumentParser:
    parser = BenchParser("layerlift bench transfer-sglang", __doc__.splitlines()[0])
    add_output_options(parser)
    add_case_options(parser, sizes="--page-sizes", default=[64, 128],
                     sizes_help="tokens per page, comma-separated")
    add_link_options(parser)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return run_host_bench(
        "transfer-sglang", args, argv, loopback=partial(run_loopback, args),
        cluster=partial(run_cluster, args=args), netns=partial(run_netns, args=args),
        layout="SGLang 0.5.23's real cache on CPU: 32 layers (30 full attention, one sliding "
               "window of 128, one Mamba), 8 KV heads x 128, bf16; raw rows: 32-layer page "
               "objects of the same pages",
        timing="per repeat the raw client, LayerLiftLinker and MooncakeDirectLinker in rotated "
               "order; ratios per repeat; every restore checked byte-exact")


if __name__ == "__main__":
    sys.exit(main())
