"""vLLM's worker as rows of the transfer benchmark, beside raw Mooncake calls, one run.

    layerlift bench transfer-vllm [--tokens 8192] [--block-sizes 16,128] [--repeats 5]
        [--netns RATE ...] [--no-loopback] [--json PATH] [--markdown PATH]

``layerlift bench transfer`` times the engine's transfer against raw
Mooncake; this is the same for LayerLift's vLLM worker (``BlockWorker``,
what ``LayerLiftConnector`` runs on each vLLM worker) over vLLM's KV cache
tensors at a real model's layout (32 attention layers, 8 KV heads x 128,
bf16; vLLM's CPU attention backend's tensor per layer,
``[num_blocks, kv_heads, block_size, 2 * head_dim]``), with no forward:
how fast one prompt moves between vLLM's blocks and the store.

Each repeat runs three units, their order rotated per repeat:

* ``raw``: ``raw ranged d4`` (``bench transfer``'s: one ``get_ranges`` per
  layer of every page object, four layers in flight, inside one read
  session, no checksum), ``raw ranged d4 + check`` (the same read
  after one call of every footer, each layer's slices checked against them
  by the thread that read them: LayerLift's check and nothing else) and
  ``raw put`` (one ``put`` of every object), the same payload in
  LayerLift's object layout;
* ``layerlift``: one worker offloads the prompt (a ``save`` of every block
  under new page hashes as one job whose blocks the scheduler holds, as
  ``LayerLiftConnector`` runs with vLLM's block pool bound; timed from the
  call until the last put ended; ``save call`` is the part vLLM's thread
  waits in: handing the job over, the copies run after it), then a
  second worker, over its own zeroed tensors, restores it twice: ``per
  layer`` (a synchronous load, as vLLM runs a single-group model:
  ``start_loads``, then ``wait_layer`` for every layer in order as the
  forward calls it, then ``step_errors``) and ``whole request`` (an
  asynchronous load, as hybrids run: ``start_loads`` until ``results``
  reports it). After each restore, not timed, every block is compared with
  the source as integers: a restore that is not exact ends the benchmark;
* ``vllm``: vLLM 0.32's own ``MooncakeStoreConnector``, both of its roles
  under vLLM's ``Scheduler``, in a child process (``transfer_vllm_msc``:
  only where vLLM is importable, ``.venv-vllm``; else, or with
  ``--no-msc``, its rows are left out): a save and a load of a new prompt
  of the same size and layout, checked byte-exact there. It empties the
  store before each round (its own reset), so ``raw`` puts its objects
  again first, not timed.

Both LayerLift workers run as the connector builds them: the default 64 MiB
staging ring (``client_buffer_bytes``), ``max_in_flight`` 8, per-layer
restores in place into the blocks where the worker picks it (blocks of
256 KiB a layer or more; whole-request restores stay staged; ``--with-staged`` adds ``per layer, staged`` and ``whole request,
staged``: a third worker that restores through the staging ring only, in
the same rounds, the two workers taking turns to go first, and their
paired ratios, ``default / staged restores``);
vLLM's connector with its defaults. GB/s is of page bytes (footers not counted);
``/ raw`` is the median of the per-repeat ratios of a load to ``raw ranged
d4`` and of an offload to ``raw put``, ``/ MooncakeStoreConnector`` of a
LayerLift row to vLLM's connector's load or save; ``cores`` the process's
CPU time over the wall time; ``machine`` the cores busy on the whole
machine meanwhile (every process, vLLM's connector's child included, and
the kernel's work). Every row's client has no segment of its own:
on loopback the store's one segment is in a client of its own in this
process (a storage node), so every put and read crosses TCP; ``--netns
RATE``: a master and a storage node holding the only segment on namespace
hosts of their own, the rows' clients on a third host behind a ``tbf`` link
of RATE.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import subprocess
import sys
import tempfile
import uuid
from collections.abc import Callable
from contextlib import ExitStack
from functools import partial
from pathlib import Path
from typing import Any

import torch

from layerlift.bench.args import BenchParser
from layerlift.bench.netns_link import add_link_options
from layerlift.bench.output import add_output_options
from layerlift.bench.transfer import Bench, Clock, Step
from layerlift.bench.transfer import Layout as RawLayout
from layerlift.bench.transfer_hosts import NotMeasured, Rounds, add_case_options, run_host_bench
from layerlift.bench.transfer_report import (
    RAW_CHECKED,
    RAW_LOAD,
    RAW_PUT,
    host_rows_table,
    plot_kinds,
)
from layerlift.engine.config import EngineConfig
from layerlift.hosts.vllm.layout import GroupKind, GroupLayout, Layout
from layerlift.hosts.vllm.meta import LoadSpec, SaveSpec
from layerlift.hosts.vllm.worker import BlockWorker
from layerlift.linker.master import EmbeddedMaster
from layerlift.linker.mooncake_config import MooncakeConfig
from layerlift.linker.mooncake_store import MooncakeStore
from layerlift.linker.store_base import Store

__all__ = ["build_parser", "main", "render_table"]

LAYERS, KV_HEADS, HEAD_DIM, DTYPE = 32, 8, 128, torch.bfloat16
SAVE, SAVE_CALL = "LayerLift save", "LayerLift save call"
PER_LAYER, WHOLE = "LayerLift per layer", "LayerLift whole request"
PER_LAYER_STAGED, WHOLE_STAGED = "LayerLift per layer, staged", "LayerLift whole request, staged"
MSC_LOAD, MSC_SAVE = "MooncakeStoreConnector load", "MooncakeStoreConnector save"
LEASE_MS = 5000  # the loopback master's read lease, `layerlift master`'s: a raw read's
# session must outlive one layer's read of every object (1.4 s at block 16)


def _require(ok: object, what: str) -> None:
    if not ok:
        raise RuntimeError(f"bench transfer-vllm: {what}")


def vllm_layout(block: int) -> Layout:
    """One full-attention group of ``LAYERS`` layers, vLLM's layer names."""
    names = tuple(f"model.layers.{i}.self_attn.attn" for i in range(LAYERS))
    block_bytes = 2 * block * KV_HEADS * HEAD_DIM * torch.finfo(DTYPE).bits // 8
    return Layout((GroupLayout(0, GroupKind.FULL, names),), block,
                  dict.fromkeys(names, block_bytes), "bench-transfer-vllm", "bfloat16")


def kv_caches(layout: Layout, blocks: int, seed: int | None) -> dict[str, torch.Tensor]:
    """vLLM's CPU KV tensors, random bits (``seed``) or zeros (None)."""
    shape = (blocks, KV_HEADS, layout.page_size, 2 * HEAD_DIM)
    names = layout.groups[0].layer_names
    if seed is None:
        return {n: torch.zeros(shape, dtype=DTYPE) for n in names}
    gen = torch.Generator().manual_seed(seed)
    return {n: torch.randint(-(1 << 15), 1 << 15, shape, dtype=torch.int16,
                             generator=gen).view(DTYPE) for n in names}


class _Child:
    """``transfer_vllm_msc`` in a child process: one JSON line a command."""

    def __init__(self, argv: list[str], timeout_s: float) -> None:
        # Its log (vLLM's, Mooncake's) to a file: a pipe nobody reads would fill and stop it.
        self.log = tempfile.TemporaryFile("w+")  # noqa: SIM115 (closed in __exit__)
        self.proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=self.log, text=True)
        self.timeout_s = timeout_s
        ready = self._line()
        _require(ready.get("ready"), f"vLLM's connector did not start: {ready}")

    def _line(self) -> dict[str, Any]:
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line:
            self.proc.wait(self.timeout_s)
            self.log.seek(0)
            tail = "\n".join(self.log.read().splitlines()[-15:])
            raise RuntimeError(f"bench transfer-vllm: vLLM's connector's process exited with "
                               f"{self.proc.returncode}:\n{tail}")
        got: dict[str, Any] = json.loads(line)
        return got

    def ask(self, command: str) -> dict[str, Any]:
        assert self.proc.stdin is not None
        self.proc.stdin.write(command + "\n")
        self.proc.stdin.flush()
        return self._line()

    def __enter__(self) -> _Child:
        return self

    def __exit__(self, *exc: object) -> None:
        try:
            if self.proc.poll() is None:
                assert self.proc.stdin is not None
                self.proc.stdin.write("quit\n")
                self.proc.stdin.flush()
            self.proc.communicate(timeout=self.timeout_s)
        except (OSError, subprocess.TimeoutExpired):
            self.proc.kill()
            self.proc.wait()
        finally:
            self.log.close()


class Case:
    """One prompt length and block size: the raw client's objects, a saving
    and a restoring worker over vLLM-shaped tensors."""

    def __init__(self, tokens: int, block: int, client: Store, timeout_s: float,
                 msc: list[str] | None, with_staged: bool = False) -> None:
        self.blocks = tokens // block
        self.n = self.blocks * block
        self.timeout_s = timeout_s
        self.client = client
        self.layout = vllm_layout(block)
        self.names = self.layout.groups[0].layer_names
        self.payload = self.blocks * sum(self.layout.layer_bytes.values())
        config = EngineConfig(store="memory")
        with ExitStack() as stack:
            self.raw = Bench(client, RawLayout(LAYERS, KV_HEADS, HEAD_DIM, 2, block), self.n,
                             timeout_s)
            stack.callback(self.raw.close)
            _require(self.raw.payload == self.payload, "raw rows of another size")
            self._restored: list[str] = []
            self._job = 0
            self._flip = False
            stack.callback(self._remove_restored)
            self.src = kv_caches(self.layout, self.blocks, seed=block)
            self.dst = kv_caches(self.layout, self.blocks, seed=None)
            namespace = f"bench-transfer-vllm-{uuid.uuid4().hex[:8]}"

            def worker(store: Store, kv: dict[str, torch.Tensor],
                       in_place: bool = True) -> BlockWorker:
                w = BlockWorker(store, self.layout, kv, schema=self.layout.schema(namespace),
                                staging_bytes=config.client_buffer_bytes,
                                max_in_flight=config.max_in_flight, load_timeout_s=timeout_s,
                                in_place_restores=in_place)
                stack.callback(w.close, timeout_s)
                return w

            self.saver = worker(client, self.src)
            self.loader = worker(client, self.dst)
            # The A/B of in-place restores, in the same rounds: a worker that
            # restores through the staging ring only.
            self.staged_loader = worker(client, self.dst, in_place=False) if with_staged \
                else None
            self.msc = None if msc is None else stack.enter_context(_Child(
                [*msc, "--tokens", str(self.n), "--block", str(block), "--layers", str(LAYERS),
                 "--kv-heads", str(KV_HEADS), "--head-dim", str(HEAD_DIM),
                 "--timeout", str(timeout_s)], timeout_s))
            self._closing = stack.pop_all()

    def close(self) -> None:
        self._closing.close()

    def raw_unit(self) -> dict[str, Step]:
        """The raw rows (``Bench.raw_rows``). The objects are put again
        first, not timed: vLLM's connector empties the store before each of
        its rounds."""
        self.raw.reput()
        return self.raw.raw_rows(self.client)

    def layerlift_unit(self) -> dict[str, Step]:
        """A save of every block under new hashes, then both restores, each checked."""
        self._remove_restored()  # the last unit's objects: their read lease ran out meanwhile
        hashes = [uuid.uuid4().bytes for _ in range(self.blocks)]
        items = [(0, h, b) for b, h in enumerate(hashes)]
        keys = [key for _, key, _ in self.saver.keyed(items)]
        out: dict[str, Step] = {}
        self._job += 1  # as vLLM's scheduler: the blocks held until the job is reported
        clock = Clock()
        self.saver.begin_step()
        self.saver.save([SaveSpec("bench", items, self._job)])
        out[SAVE_CALL] = clock.stop(self.payload)
        _require(self.saver.settle(self.timeout_s), "a save did not end in time")
        out[SAVE] = clock.stop(self.payload)
        report = self.saver.report()
        _require(report is not None and report.saved == {self._job: 1},
                 f"the save job was not reported done once ({report})")
        _require(all(self.client.exists(keys)), "a save stored fewer objects than it was given")
        self._restored = keys
        default = [(PER_LAYER, True, self.loader), (WHOLE, False, self.loader)]
        staged = [] if self.staged_loader is None else [
            (PER_LAYER_STAGED, True, self.staged_loader), (WHOLE_STAGED, False, self.staged_loader)]
        self._flip = not self._flip  # the A/B's two workers take turns to go first
        for row, sync, w in (staged + default if self._flip else default + staged):
            out[row] = self._restore(items, sync=sync, w=w)
        return out

    def msc_unit(self) -> dict[str, Step]:
        """One round of vLLM's own connector in its child: a save and a load
        of a new prompt, checked there (``transfer_vllm_msc``)."""
        assert self.msc is not None
        got = self.msc.ask("round")
        if "error" in got:
            raise NotMeasured(f"vLLM's MooncakeStoreConnector: {got['error']}")
        _require(got["exact"], "vLLM's MooncakeStoreConnector restored wrong bytes "
                               f"({got['load_errors']} blocks reported failed)")
        nbytes = int(got["bytes"])
        _require(nbytes == self.payload, f"vLLM's connector moved {nbytes} bytes a prompt, "
                                         f"LayerLift {self.payload}")
        return {MSC_SAVE: Step(nbytes / got["save_s"] / 1e9, got["save_cpu"] / got["save_s"],
                               got.get("save_machine")),
                MSC_LOAD: Step(nbytes / got["load_s"] / 1e9, got["load_cpu"] / got["load_s"],
                               got.get("load_machine"))}

    def _remove_restored(self) -> None:
        """Remove the objects the last unit saved (waiting out what is left
        of their read lease)."""
        keys, self._restored = self._restored, []
        self.raw.remove_keys(keys)

    def _restore(self, items: list[tuple[int, bytes, int]], *, sync: bool,
                 w: BlockWorker | None = None) -> Step:
        for t in self.dst.values():
            t.zero_()
        w = w or self.loader
        clock = Clock()
        w.begin_step()
        w.start_loads([LoadSpec("bench", items, sync=sync)])
        if sync:
            for name in self.names:
                w.wait_layer(name)
            _require(w.step_errors() == set(), "a per-layer restore failed")
        else:
            done, failed = w.results(wait_s=self.timeout_s)
            _require(done == {"bench"} and not failed, f"a whole-request restore failed "
                     f"(finished {sorted(done)}, failed {sorted(failed)})")
        took = clock.stop(self.payload)
        _require(all(torch.equal(self.dst[n].view(torch.int16), self.src[n].view(torch.int16))
                     for n in self.names), "a restore wrote wrong bytes")
        return took


def measure(case: Case, repeats: int) -> dict[str, Any]:
    """Round -1 warms up (checked, not timed); then ``repeats`` rounds of the
    rotated units. A unit that raises :class:`NotMeasured` leaves the case:
    its rows are ``not measured`` with the reason, in every round (ratios
    stay paired over the same rounds)."""
    units: dict[str, Callable[[], dict[str, Step]]] = {
        "raw": case.raw_unit, "layerlift": case.layerlift_unit}
    if case.msc is not None:
        units["vllm"] = case.msc_unit
    rounds = Rounds(units, repeats)
    ratio, failed = rounds.ratio, rounds.failed

    loads, offloads = [RAW_LOAD, RAW_CHECKED, PER_LAYER, WHOLE], [RAW_PUT, SAVE, SAVE_CALL]
    staged: dict[str, Any] = {}
    if case.staged_loader is not None:
        loads += [PER_LAYER_STAGED, WHOLE_STAGED]
        staged = {PER_LAYER: ratio(PER_LAYER, PER_LAYER_STAGED), WHOLE: ratio(WHOLE, WHOLE_STAGED)}
    paired: dict[str, Any] = {}
    if case.msc is not None and "vllm" not in failed:
        loads.append(MSC_LOAD)
        offloads.append(MSC_SAVE)
        paired = {PER_LAYER: ratio(PER_LAYER, MSC_LOAD), WHOLE: ratio(WHOLE, MSC_LOAD),
                  SAVE: ratio(SAVE, MSC_SAVE)}
    return {
        "tokens": case.n, "block": case.layout.page_size, "repeats": repeats,
        "payload_bytes": case.payload, "LayerLift / MooncakeStoreConnector": paired,
        **({"default / staged restores": staged} if staged else {}),
        **rounds.spreads("loads", {k: k for k in loads}, RAW_LOAD),
        **rounds.spreads("offloads", {k: k for k in offloads}, RAW_PUT),
        "not measured": {row: why for unit, why in failed.items()
                         for row in ((MSC_LOAD, MSC_SAVE) if unit == "vllm" else ())},
    }  # fmt: skip


def msc_command(master: str, metadata: str) -> list[str] | None:
    """How to start vLLM's connector's child for a store, or None where
    vLLM is not importable (the main environment: run from ``.venv-vllm``)."""
    if importlib.util.find_spec("vllm") is None:
        return None
    return [sys.executable, "-m", "layerlift.bench.transfer_vllm_msc", "--master", master,
            "--metadata", metadata]


def run_cases(client: Store, msc: list[str] | None, args: argparse.Namespace) -> dict[str, Any]:
    out: dict[str, Any] = {}
    if msc is None or args.no_msc:
        print("  vLLM's MooncakeStoreConnector: not measured ("
              + ("--no-msc" if args.no_msc else "vLLM is not importable here: run from "
                 ".venv-vllm") + ")", flush=True)
        msc = None
    for tokens in args.tokens:
        for block in args.block_sizes:
            label = f"{tokens} tokens, block {block}"
            print(f"  {label}", flush=True)
            case = Case(tokens, block, client, args.timeout, msc, with_staged=args.with_staged)
            try:
                out[label] = measure(case, args.repeats)
                ab = out[label].get("default / staged restores")
                if ab:
                    print("    default / staged restores (median of per-round ratios): "
                          + ", ".join(f"{row} {r['median']:.2f} [{r['min']:.2f}, {r['max']:.2f}]"
                                      for row, r in ab.items()), flush=True)
            finally:
                case.close()
    return out


def _segment(args: argparse.Namespace) -> int:
    """The store's segment: the raw objects, a raw put, two saved prompts
    (the last unit's, removed once its read lease ran out) and vLLM's
    connector's at once for the biggest case, with slack."""
    biggest = max(RawLayout(LAYERS, KV_HEADS, HEAD_DIM, 2, block).object_bytes * (tokens // block)
                  for tokens in args.tokens for block in args.block_sizes)
    return int(5.5 * biggest) + (256 << 20)


def run_loopback(args: argparse.Namespace) -> dict[str, Any]:
    """The segment in a client of its own (a storage node in this process);
    every row's client has none: each put and read crosses TCP loopback."""
    with ExitStack() as stack:
        master = stack.enter_context(EmbeddedMaster(lease_ttl_ms=LEASE_MS, http_metadata=False))
        stack.enter_context(MooncakeStore(master.config(
            global_segment_size=_segment(args), timeout_s=args.timeout)))
        client = stack.enter_context(MooncakeStore(master.config(
            global_segment_size=0, local_buffer_size=16 << 20, timeout_s=args.timeout)))
        return run_cases(client, msc_command(master.master_address, master.metadata_url), args)


def run_cluster(master: str, args: argparse.Namespace) -> dict[str, Any]:
    """On a namespace link's engine host: a client of the one master, no segment."""
    from layerlift.engine.stores import route_source

    local = route_source(master)
    client = MooncakeStore(MooncakeConfig(
        master_address=master, local_hostname=local, global_segment_size=0,
        local_buffer_size=16 << 20, timeout_s=args.timeout))
    with client:
        return run_cases(client, msc_command(master, "P2PHANDSHAKE"), args)


def run_netns(rate: str, args: argparse.Namespace) -> dict[str, Any]:
    from layerlift.bench.netns_link import engine_host_json, netns_cluster

    with tempfile.TemporaryDirectory(prefix="layerlift-transfer-vllm-") as tmp, netns_cluster(
            rate, _segment(args), tmp) as (hosts, master):
        out = Path(tmp) / "cases.json"
        child = [sys.executable, "-m", "layerlift.cli", "bench", "transfer-vllm",
                 "--tokens", ",".join(map(str, args.tokens)),
                 "--block-sizes", ",".join(map(str, args.block_sizes)),
                 "--repeats", str(args.repeats), "--timeout", str(args.timeout),
                 *(["--no-msc"] if args.no_msc else []),
                 *(["--with-staged"] if args.with_staged else []),
                 "--cluster", master, "--json", str(out)]
        cases: dict[str, Any] = engine_host_json(hosts, child, tmp, out)["cases"]
        return cases


def render_table(record: dict[str, Any]) -> str:
    """The results page's tables: loads, then offloads, per link and case."""

    def paired(c: dict[str, Any], kind: str, row: str) -> dict[str, float] | None:
        ratios: dict[str, dict[str, float]] = c.get("LayerLift / MooncakeStoreConnector") or {}
        return ratios.get(row)

    return host_rows_table(record, host="MooncakeStoreConnector", paired=paired,
                           not_measured_in=lambda kind, row: (row == MSC_LOAD) == (kind == "loads"))


def plot_record(record: dict[str, Any], path: str) -> None:
    """Median GB/s of every row, loads and offloads, one group per link and case."""
    plot_kinds(record, path, ["loads", "offloads"], lambda kind: f"vLLM's worker: {kind}")


def build_parser() -> argparse.ArgumentParser:
    parser = BenchParser("layerlift bench transfer-vllm", __doc__.splitlines()[0])
    add_output_options(parser)
    add_case_options(parser, sizes="--block-sizes", default=[16, 128],
                     sizes_help="vLLM's tokens per block, comma-separated")
    parser.add_argument("--no-msc", action="store_true",
                        help="leave vLLM's MooncakeStoreConnector out (it needs vLLM 0.32: "
                             "without it, it is left out anyway)")
    parser.add_argument("--with-staged", action="store_true",
                        help="also restore through the staging ring only (a worker with "
                             "in_place_restores=False), in the same rounds: the A/B of "
                             "in-place restores")
    add_link_options(parser)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return run_host_bench(
        "transfer-vllm", args, argv, loopback=partial(run_loopback, args),
        cluster=partial(run_cluster, args=args), netns=partial(run_netns, args=args),
        layout=f"vLLM's CPU KV tensors, {LAYERS} attention layers, {KV_HEADS} KV heads x "
               f"{HEAD_DIM}, bf16, one KV cache group; raw rows: {LAYERS}-layer page objects "
               "of the same pages",
        timing="per repeat the raw client, LayerLift's worker and vLLM's "
               "MooncakeStoreConnector (where measured) in rotated order; ratios per repeat; "
               "every restore checked byte-exact; cores of vLLM's connector: its own process's "
               "(the storage side's not counted)")


if __name__ == "__main__":
    sys.exit(main())
