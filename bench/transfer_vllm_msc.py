"""vLLM's own ``MooncakeStoreConnector`` as a row of ``bench transfer-vllm``: a child process.

    .venv-vllm/bin/python -m layerlift.bench.transfer_vllm_msc --master HOST:PORT
        --metadata URL --tokens N --block B --layers L --kv-heads H --head-dim D

``layerlift bench transfer-vllm`` starts one per case (it needs vLLM 0.32,
``.venv-vllm``) and drives it over its standard streams: it prints one JSON
line when ready, then for each line ``round`` on its input it saves and
restores one new prompt and prints one JSON line; ``quit`` ends it.

Inside: vLLM's connector in both of its roles, as an engine runs them,
without a model: vLLM's ``Scheduler`` with the connector's scheduler side
(its lookups, its per-request metadata: what vLLM really sends) and the
connector's worker side (``MooncakeStoreWorker``: its send and receive
threads) over KV cache tensors vLLM's own ``allocate_kv_cache`` lays out for
the CPU attention backend (a Llama-like model of L layers, H KV heads x D,
bf16, written as a ``config.json`` only: nothing is downloaded, no weights).
The worker runs in ``standalone-store`` mode with no segment of its own: its
puts and reads cross TCP to the segment of the parent's store, as
LayerLift's worker's do.

One round:

* **save**: a new prompt of N tokens is scheduled; its blocks get random
  bits (the forward's stand-in); timed from ``start_load_kv`` /
  ``wait_for_save`` (vLLM's calls after a forward) until the worker's
  metadata reports the store job complete;
* **load**: the same prompt and one more token (vLLM computes at least the
  last token: so every block of the prompt is a hit) is scheduled; the
  connector's lookup must find all N tokens (else the round reports how
  many: a save that lost objects), its blocks are zeroed, then timed from
  ``start_load_kv`` until ``get_finished`` reports the request received;
  every block is compared with what the save wrote (``exact``).

The store is emptied before each round (the scheduler's
``reset_prefix_cache(reset_connector=True)``: the connector's own reset,
``remove_all``): the parent puts its own objects again where it needs them.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import socket
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from layerlift.bench import machine_cpu


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _until(done: Callable[[], bool], timeout_s: float, what: str) -> None:
    deadline = time.perf_counter() + timeout_s
    while not done():
        if time.perf_counter() > deadline:
            raise TimeoutError(f"{what} not done after {timeout_s:g} s")
        time.sleep(0.0005)


class Connector:
    """vLLM's scheduler and MooncakeStoreConnector's two sides over CPU KV caches."""

    def __init__(self, args: argparse.Namespace, workdir: Path) -> None:
        import torch
        import vllm.v1.worker.cpu.shm  # noqa: F401  (vLLM's CPU worker's torch.Event stand-ins)
        from transformers import LlamaConfig
        from vllm.config import set_current_vllm_config
        from vllm.distributed.kv_transfer import get_kv_transfer_group
        from vllm.distributed.kv_transfer.kv_transfer_state import (
            ensure_kv_transfer_initialized,
        )
        from vllm.engine.arg_utils import EngineArgs
        from vllm.utils.hashing import get_hash_fn_by_name
        from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend
        from vllm.v1.attention.backends.utils import resolve_kv_cache_layout
        from vllm.v1.core.kv_cache_utils import (
            generate_scheduler_kv_cache_config,
            get_kv_cache_configs,
            get_request_block_hasher,
            init_none_hash,
            resolve_kv_cache_block_sizes,
        )
        from vllm.v1.core.sched.scheduler import Scheduler
        from vllm.v1.core.single_type_kv_cache_manager import register_all_kvcache_specs
        from vllm.v1.kv_cache_interface import FullAttentionSpec
        from vllm.v1.structured_output import StructuredOutputManager
        from vllm.v1.worker.gpu_worker import init_worker_distributed_environment
        from vllm.v1.worker.utils import allocate_kv_cache

        self.args = args
        self.blocks = args.tokens // args.block
        self.tokens = self.blocks * args.block
        model = workdir / "model"
        LlamaConfig(hidden_size=4 * args.kv_heads * args.head_dim,
                    num_attention_heads=4 * args.kv_heads, num_key_value_heads=args.kv_heads,
                    head_dim=args.head_dim, num_hidden_layers=args.layers,
                    intermediate_size=4096, vocab_size=32000,
                    max_position_embeddings=2 * self.tokens + 64,
                    architectures=["LlamaForCausalLM"]).save_pretrained(model)
        config = workdir / "mooncake.json"
        config.write_text(json.dumps({
            "metadata_server": args.metadata, "master_server_address": args.master,
            "protocol": "tcp", "device_name": "", "mode": "standalone-store",
            "global_segment_size": 0, "local_buffer_size": 64 << 20}))
        os.environ["MOONCAKE_CONFIG_PATH"] = str(config)
        # Both requests' blocks at once (the save's stay held until its job
        # reports back), the null block, slack.
        num_blocks = 2 * self.blocks + 8
        self.vc = EngineArgs(
            model=str(model), skip_tokenizer_init=True, dtype="bfloat16",
            max_model_len=2 * self.tokens + 64, block_size=args.block,
            enable_prefix_caching=False,  # every hit comes from the store
            enforce_eager=True, max_num_batched_tokens=2 * self.tokens + 64, seed=0,
            num_gpu_blocks_override=num_blocks,
            kv_transfer_config={"kv_connector": "MooncakeStoreConnector", "kv_role": "kv_both",
                                "kv_load_failure_policy": "recompute",
                                "kv_connector_extra_config": {"lookup_rpc_port": _free_port()}},
        ).create_engine_config()
        self._config_scope = set_current_vllm_config(self.vc)
        self._config_scope.__enter__()
        init_worker_distributed_environment(
            self.vc, rank=0, distributed_init_method=f"tcp://127.0.0.1:{_free_port()}",
            local_rank=0, backend="gloo")
        register_all_kvcache_specs(self.vc)
        specs = {f"model.layers.{i}.self_attn.attn": FullAttentionSpec(
            block_size=args.block, num_kv_heads=args.kv_heads, head_size=args.head_dim,
            dtype=torch.bfloat16) for i in range(args.layers)}
        layout = resolve_kv_cache_layout(
            self.vc, [[x.name for x in CPUAttentionBackend.supported_kv_cache_layouts()]],
            list(specs.values()))
        self.vc.cache_config.kv_cache_layout = layout.name
        page = next(iter(specs.values())).page_size_bytes
        configs = get_kv_cache_configs(self.vc, [specs], [num_blocks * args.layers * page])
        kv_config = configs[0]
        kv_config.kv_cache_layout = layout.name
        sched_config = generate_scheduler_kv_cache_config(configs)
        self.vc.cache_config.num_gpu_blocks = sched_config.num_blocks
        block_size, hash_block = resolve_kv_cache_block_sizes(sched_config, self.vc)
        self.kv: dict[str, torch.Tensor] = allocate_kv_cache(
            kv_config, torch.device("cpu"), layout, [args.block])
        ensure_kv_transfer_initialized(self.vc, kv_config)
        self.worker: Any = get_kv_transfer_group()
        self.worker.register_kv_caches(self.kv)
        hash_fn = get_hash_fn_by_name(self.vc.cache_config.prefix_caching_hash_algo)
        init_none_hash(hash_fn)
        self.hasher = get_request_block_hasher(hash_block, hash_fn)
        self.sched = Scheduler(vllm_config=self.vc, kv_cache_config=sched_config,
                               structured_output_manager=StructuredOutputManager(self.vc),
                               block_size=block_size, hash_block_size=hash_block,
                               log_stats=False)
        self.payload = self.blocks * sum(
            int(t[0].numel() * t.element_size()) for t in self.kv.values())
        self.rounds = 0

    def close(self) -> None:
        from vllm.distributed.kv_transfer.kv_transfer_state import ensure_kv_transfer_shutdown

        ensure_kv_transfer_shutdown()
        self._config_scope.__exit__(None, None, None)

    def _request(self, rid: str, tokens: list[int]) -> Any:
        from vllm.sampling_params import SamplingParams
        from vllm.v1.request import Request

        return Request(rid, tokens, SamplingParams(max_tokens=1, temperature=0.0), None,
                       block_hasher=self.hasher)

    def _step(self, meta: Any, finished: set[str], done: Callable[[], bool],
              what: str) -> tuple[Any, float, float, float | None]:
        """The worker's calls of one step (vLLM's order after the forward),
        then wait for ``done``; the transfer results, wall and CPU seconds,
        and the machine's busy cores meanwhile (None: not read)."""
        from vllm.forward_context import get_forward_context, set_forward_context

        with set_forward_context(None, self.vc):
            self.worker.bind_connector_metadata(meta)
            before = machine_cpu.sample()
            wall, cpu = time.perf_counter(), time.process_time()
            self.worker.start_load_kv(get_forward_context())
            self.worker.wait_for_save()
            _until(done, self.args.timeout, f"the connector's {what}")
            took = time.perf_counter() - wall, time.process_time() - cpu
            busy = machine_cpu.cores(before, machine_cpu.sample())
            results = self.worker.get_transfer_results(finished)
            self.worker.clear_connector_metadata()
        return results, *took, busy

    def round(self) -> dict[str, Any]:
        import torch
        from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.store.data import (
            MooncakeStoreWorkerMetadata,
        )
        from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput
        from vllm.v1.request import RequestStatus

        n, sched = self.rounds, self.sched
        self.rounds += 1
        sched.reset_prefix_cache(reset_connector=True)  # the store: empty
        rng = random.Random(1000 + n)
        prompt = [rng.randrange(3, 30000) for _ in range(self.tokens)]
        saving, loading = f"save-{n}", f"load-{n}"
        # ---- save
        sched.add_request(self._request(saving, prompt))
        out = sched.schedule()
        blocks = list(out.scheduled_new_reqs[0].block_ids[0])[: self.blocks]
        job = next(r for r in out.kv_connector_metadata.requests if r.can_save).store_job_id
        index = torch.tensor(blocks)
        gen = torch.Generator().manual_seed(n)
        saved = {}
        for name, cache in self.kv.items():
            bits = torch.randint(-(1 << 15), 1 << 15, cache[index].shape, dtype=torch.int16,
                                 generator=gen)
            cache[index] = bits.view(cache.dtype)
            saved[name] = bits
        completed: dict[int, int] = {}

        def saved_all() -> bool:
            meta = self.worker.build_connector_worker_meta()
            if meta is not None:
                for k, v in meta.completed_saves.items():
                    completed[k] = completed.get(k, 0) + v
            return job in completed

        results, save_s, save_cpu, save_machine = self._step(
            out.kv_connector_metadata, out.finished_req_ids, saved_all, "save")
        sched.update_from_output(out, ModelRunnerOutput(
            req_ids=[saving], req_id_to_index={saving: 0}, sampled_token_ids=[[7]],
            kv_connector_output=KVConnectorOutput(
                finished_sending=results.finished_sending,
                finished_recving=results.finished_recving,
                kv_connector_worker_meta=MooncakeStoreWorkerMetadata(
                    completed_saves=dict(completed)))))
        record: dict[str, Any] = {"bytes": self.payload, "save_s": save_s, "save_cpu": save_cpu,
                                  "save_machine": save_machine}
        # ---- load
        sched.add_request(self._request(loading, [*prompt, 11]))
        out = sched.schedule()
        spec = next((r for r in out.kv_connector_metadata.requests if r.load_spec is not None),
                    None)
        hit = 0 if spec is None or not spec.load_spec.can_load else int(
            spec.load_spec.kvpool_cached_tokens)
        record["hit_tokens"] = hit
        if spec is None or hit != self.tokens:
            sched.finish_requests(loading, RequestStatus.FINISHED_ABORTED)
            record["error"] = f"the store held {hit} of the {self.tokens} tokens just saved"
            return record
        index = torch.tensor(list(spec.block_ids[0])[: self.blocks])
        for cache in self.kv.values():
            cache[index] = 0
        received: set[str] = set()

        def loaded() -> bool:
            _, got = self.worker.get_finished(out.finished_req_ids)
            received.update(got or ())
            return loading in received

        results, load_s, load_cpu, load_machine = self._step(
            out.kv_connector_metadata, out.finished_req_ids, loaded, "load")
        if self.args.spoil:  # the tests' negative control: one restored byte flipped
            first = next(iter(self.kv.values()))
            first[index[0]].view(torch.uint8).view(-1)[0] ^= 0xFF
        errors = self.worker.get_block_ids_with_load_errors()
        record.update(load_s=load_s, load_cpu=load_cpu, load_machine=load_machine,
                      load_errors=len(errors),
                      exact=not errors and all(
                          torch.equal(c[index].view(torch.int16), saved[name])
                          for name, c in self.kv.items()))
        sched.update_from_output(out, ModelRunnerOutput(
            req_ids=[], req_id_to_index={},
            kv_connector_output=KVConnectorOutput(finished_recving=received)))
        sched.finish_requests(loading, RequestStatus.FINISHED_ABORTED)
        return record


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="transfer_vllm_msc", description=__doc__.splitlines()[0])
    ap.add_argument("--master", required=True)
    ap.add_argument("--metadata", required=True)
    ap.add_argument("--tokens", type=int, required=True)
    ap.add_argument("--block", type=int, required=True)
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--timeout", type=float, default=120.0)
    ap.add_argument("--spoil", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    reply = sys.stdout
    sys.stdout = sys.stderr  # vLLM's prints never mix with the replies
    with tempfile.TemporaryDirectory(prefix="layerlift-msc-") as tmp:
        conn = Connector(args, Path(tmp))
        try:
            print(json.dumps({"ready": True, "bytes": conn.payload}), file=reply, flush=True)
            for line in sys.stdin:
                if line.strip() != "round":
                    break
                try:
                    record = conn.round()
                except Exception as exc:  # reported to the parent, which ends the run
                    record = {"error": f"{type(exc).__name__}: {exc}"}
                print(json.dumps(record), file=reply, flush=True)
        finally:
            conn.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
