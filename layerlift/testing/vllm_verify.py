"""Serve prompts with vLLM in a child process, for the host tests and the benchmark.

``python -m layerlift.testing.vllm_verify tiny KIND DIR`` writes a tiny model
with seeded random weights (``gemma3``: sliding + full attention; ``llama``:
full attention only; ``nemotron_h``: Mamba-2 + attention) into ``DIR``.

``python -m layerlift.testing.vllm_verify serve --model DIR [--connector
layerlift|mooncake|none] [--extra JSON] [--kv-bytes N] [--prefix-caching]
[--scheduler-cls CLS]``
builds one `vllm.LLM` (CPU, float32, eager, no tokenizer, prefix caching off
unless ``--prefix-caching``, 256 MiB of KV cache by default) and then answers
JSON commands, one per stdin line, with one ``LLJSON {...}`` line each on
stdout: ``{"op": "generate", "prompts": [[ids...]], "logprobs": K}`` → per
prompt ``num_cached_tokens``, the first token, its top-K logprobs and the
wall time of the call (``max_tokens=1``: the time to the first token; one
call per prompt); ``"batch": true`` submits all prompts in one call (vLLM
schedules them together); ``{"op": "reset_prefix_cache"}`` empties vLLM's
local prefix cache; ``{"op": "quit"}``.
vLLM starts processes, so the `LLM` is made under ``if __name__ == "__main__"``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

__all__ = ["IN_PROCESS_ENV", "kv_transfer_config", "main", "make_tiny_model"]

MARK = "LLJSON "
START_TIMEOUT_S = 600.0  # a bound on a hung child; a loaded 2-core machine takes minutes
# vLLM's engine core and its worker inside the `serve` process (one process
# instead of three spawned ones, each importing torch and vLLM: a start-up
# takes a third of the time), one torch thread as vLLM's CPU worker uses.
# The scheduler's and the worker's connector then share a process: the
# connector's metadata and reports are passed, not serialized.
IN_PROCESS_ENV = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "OMP_NUM_THREADS": "1"}


def make_tiny_model(kind: str, path: str, seed: int = 0, *, hidden: int = 128,
                    layers: int = 4, kv_heads: int = 1, head_dim: int = 64,
                    max_positions: int = 4096) -> str:
    """Save a small model with seeded random weights into ``path`` (vocab 512,
    ``hidden`` wide, ``layers`` deep; ``hidden // head_dim`` attention heads
    of ``head_dim``, ``kv_heads`` KV heads: by default heads of 64 and one KV
    head; 8 KV heads of 128 is a real model's KV layout):
    ``gemma3`` (sliding-window layers, the last one full attention),
    ``llama`` (full attention only: one KV cache group) or ``nemotron_h``
    (Mamba-2, attention, Mamba-2, MLP, repeated). Returns ``path``. Raises
    ValueError for an unknown kind or sizes that do not divide."""
    import torch
    import transformers

    if head_dim % 32 or hidden % head_dim or hidden < head_dim or layers < 2:
        raise ValueError(f"hidden must be a multiple of head_dim (itself of 32) and layers >= 2, "
                         f"got hidden {hidden}, head_dim {head_dim}, {layers} layers")
    if kv_heads < 1 or (hidden // head_dim) % kv_heads:
        raise ValueError(f"{kv_heads} KV heads do not divide {hidden // head_dim} attention heads")
    torch.manual_seed(seed)
    common: dict[str, Any] = dict(vocab_size=512, hidden_size=hidden,
                                  intermediate_size=2 * hidden,
                                  num_attention_heads=hidden // head_dim,
                                  num_key_value_heads=kv_heads, head_dim=head_dim,
                                  max_position_embeddings=max_positions)
    if kind == "gemma3":
        config: Any = transformers.Gemma3TextConfig(
            num_hidden_layers=layers, sliding_window=32,
            layer_types=["sliding_attention"] * (layers - 1) + ["full_attention"], **common)
    elif kind == "llama":
        config = transformers.LlamaConfig(num_hidden_layers=layers, **common)
    elif kind == "nemotron_h":
        pattern = ("M*M-" * layers)[:layers]
        config = transformers.NemotronHConfig(  # type: ignore[call-arg, unused-ignore]
            hybrid_override_pattern=pattern, ssm_state_size=16, mamba_num_heads=hidden // 32,
            mamba_head_dim=32, n_groups=1, expand=1, chunk_size=64, **common)
    else:
        raise ValueError(f"unknown tiny model {kind!r}; choose gemma3, llama or nemotron_h")
    model = transformers.AutoModelForCausalLM.from_config(  # type: ignore[no-untyped-call, unused-ignore]
        config, dtype=torch.float32)
    model.save_pretrained(path)
    return path


def kv_transfer_config(connector: str, extra: dict[str, Any], *,
                       standin: bool = False) -> dict[str, Any] | None:
    """The ``kv_transfer_config`` of a run: LayerLift's connector, vLLM's
    MooncakeStoreConnector, or None (no connector). ``standin``: the same
    connector with ``vllm_standin``'s forward compute stand-in after each
    layer's wait (its milliseconds from that module's ``COMPUTE_ENV``)."""
    if connector == "none":
        if standin:
            raise ValueError("the compute stand-in runs in a connector's per-layer wait: "
                             "a run with no connector has none")
        return None
    names = {"layerlift": ("LayerLiftConnector", "layerlift.hosts.vllm"),
             "mooncake": ("MooncakeStoreConnector", None)}
    if connector not in names:
        raise ValueError(f"unknown connector {connector!r}; choose layerlift, mooncake or none")
    name, module = names[connector]
    if standin:
        name, module = f"StandIn{name}", "layerlift.testing.vllm_standin"
    return {"kv_connector": name, **({"kv_connector_module_path": module} if module else {}),
            "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
            "kv_connector_extra_config": extra}


class Instance:
    """The client of one ``serve`` child process (a ``vllm.LLM``). Its log
    file gets the child's stderr and the non-JSON lines of its stdout (vLLM's
    log). Every wait is bounded: a child that does not answer in time is
    killed and AssertionError raised (a test or benchmark failure).
    ``in_process``: vLLM's engine core and worker in the child itself
    (``IN_PROCESS_ENV``), for instances whose process boundary is not what
    is tested (a cold reference, an offloading first instance).
    ``wait=False``: return at once (start others meanwhile); the first
    command, or `wait_ready`, waits for the start."""

    def __init__(self, model: str, connector: str, extra: dict[str, Any] | None,
                 log_path: Path, env: dict[str, str] | None = None, *,
                 prefix_caching: bool = False, scheduler_cls: str = "",
                 failure_policy: str = "", in_process: bool = False,
                 wait: bool = True, dtype: str = "float32", max_model_len: int = 4096,
                 kv_bytes: int | None = None, compute_ms: float = 0.0) -> None:
        env = dict(os.environ, MC_LOG_LEVEL="ERROR", GLOG_minloglevel="2",
                   PYTHONUNBUFFERED="1", **(IN_PROCESS_ENV if in_process else {}), **(env or {}))
        env.pop("VLLM_CPU_KVCACHE_SPACE", None)  # it would override the serve's KV bytes
        self.log_path = log_path
        self._log = log_path.open("w")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "layerlift.testing.vllm_verify", "serve", "--model", model,
             "--connector", connector, "--extra", json.dumps(extra or {}),
             "--dtype", dtype, "--max-model-len", str(max_model_len),
             *(["--kv-bytes", str(kv_bytes)] if kv_bytes else []),
             *(["--compute-ms", repr(compute_ms)] if compute_ms else []),
             *(["--prefix-caching"] if prefix_caching else []),
             *(["--scheduler-cls", scheduler_cls] if scheduler_cls else []),
             *(["--failure-policy", failure_policy] if failure_policy else [])],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._log, text=True, env=env,
            start_new_session=True)  # its own process group: `kill` ends vLLM's children too
        self._replies: queue.Queue[dict[str, Any] | None] = queue.Queue()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()
        self._ready = False
        if wait:
            self.wait_ready()

    def wait_ready(self) -> None:
        """Until the ``LLM`` is built (at most ``START_TIMEOUT_S``); with
        ``wait=False`` the caller starts several instances, then waits."""
        if not self._ready:
            self._expect(START_TIMEOUT_S)
            self._ready = True

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            if line.startswith(MARK):
                self._replies.put(json.loads(line[len(MARK):]))
            else:
                self._log.write(line)
        self._replies.put(None)

    def _expect(self, timeout_s: float) -> dict[str, Any]:
        try:
            reply = self._replies.get(timeout=timeout_s)
        except queue.Empty:
            self.kill()
            raise AssertionError(f"vLLM instance did not answer in {timeout_s:.0f} s; "
                                 f"log: {self.log_path}") from None
        if reply is None:
            raise AssertionError(f"vLLM instance exited (code {self.proc.wait(10)}); "
                                 f"log tail:\n{self.log_tail()}")
        if "error" in reply:
            raise AssertionError(f"vLLM instance failed: {reply['error']}")
        return reply

    def generate(self, prompts: list[list[int]], timeout_s: float = 120.0, *,
                 batch: bool = False) -> list[dict[str, Any]]:
        """First token, top-5 logprobs, cached tokens and wall time per prompt
        (``batch``: all prompts in one call, the wall time is the call's)."""
        results: list[dict[str, Any]] = self._command(
            {"op": "generate", "prompts": prompts, "batch": batch}, timeout_s)["results"]
        return results

    def reset_prefix_cache(self, timeout_s: float = 60.0) -> None:
        """Empty vLLM's local prefix cache (the next lookups go to the store);
        RuntimeError when vLLM still refused after ``timeout_s`` (a block
        still referenced: the next request would hit locally, not restore)."""
        reply = self._command({"op": "reset_prefix_cache", "timeout_s": timeout_s},
                              timeout_s + 30.0)
        if not reply.get("reset"):
            raise RuntimeError(f"vLLM did not empty its prefix cache within {timeout_s} s "
                               f"({reply}); log tail:\n{self.log_tail()}")

    def _command(self, cmd: dict[str, Any], timeout_s: float) -> dict[str, Any]:
        self.wait_ready()
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(cmd) + "\n")
        self.proc.stdin.flush()
        return self._expect(timeout_s)

    def log_text(self) -> str:
        self._log.flush()
        return self.log_path.read_text(errors="replace")

    def log_tail(self, n: int = 40) -> str:
        return "\n".join(self.log_text().splitlines()[-n:])

    def close(self, timeout_s: float = 60.0) -> None:
        if self.proc.poll() is None and self.proc.stdin is not None:
            try:
                self.proc.stdin.write(json.dumps({"op": "quit"}) + "\n")
                self.proc.stdin.flush()
                self.proc.stdin.close()
            except OSError:
                pass
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.kill()
        self._log.flush()

    def kill(self) -> None:
        """SIGKILL the child's process group (vLLM's engine core and worker with it)."""
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(30)


def _generate(llm: Any, cmd: dict[str, Any]) -> dict[str, Any]:
    from vllm import SamplingParams  # type: ignore[import-not-found, unused-ignore]

    params = SamplingParams(max_tokens=1, temperature=0.0, logprobs=int(cmd.get("logprobs", 5)))
    groups = [cmd["prompts"]] if cmd.get("batch") else [[p] for p in cmd["prompts"]]
    out = []
    for group in groups:
        started = time.perf_counter()
        results = llm.generate([{"prompt_token_ids": p} for p in group], params, use_tqdm=False)
        wall = time.perf_counter() - started
        for res in results:
            first = res.outputs[0]
            logprobs = {str(t): lp.logprob for t, lp in (first.logprobs or [{}])[0].items()}
            out.append({"num_cached_tokens": res.num_cached_tokens or 0,
                        "token": first.token_ids[0], "logprobs": logprobs, "wall_s": wall})
    return {"results": out}


def _reset_prefix_cache(llm: Any, timeout_s: float) -> bool:
    """Empty vLLM's local prefix cache; True once it is. vLLM refuses while
    any block is referenced: a connector's save still holding its blocks
    (LayerLift's and vLLM's MooncakeStoreConnector's both do, until their
    workers report the put). The in-process engine steps only when asked,
    so steps run here (vLLM's own loop would, with ``has_pending_push_work``)
    until the reports released them, at most ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while not llm.reset_prefix_cache():
        if time.monotonic() > deadline:
            return False
        llm.llm_engine.step()  # an empty step: the workers' reports come with it
        time.sleep(0.01)  # the puts run on the same two cores
    return True


def _serve(args: argparse.Namespace) -> int:
    from vllm import LLM

    if args.compute_ms:
        from layerlift.testing.vllm_standin import COMPUTE_ENV

        os.environ[COMPUTE_ENV] = repr(args.compute_ms)  # vLLM's worker inherits it
    kv = kv_transfer_config(args.connector, json.loads(args.extra), standin=args.compute_ms > 0)
    if kv is not None and args.failure_policy:
        kv["kv_load_failure_policy"] = args.failure_policy
    sched: dict[str, Any] = ({"scheduler_cls": args.scheduler_cls, "async_scheduling": False}
                             if args.scheduler_cls else {})
    llm = LLM(model=args.model, skip_tokenizer_init=True, dtype=args.dtype, enforce_eager=True,
              enable_prefix_caching=args.prefix_caching, max_model_len=args.max_model_len, seed=0,
              kv_cache_memory_bytes=args.kv_bytes, kv_transfer_config=kv, **sched)
    print(MARK + json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        cmd = json.loads(line)
        if cmd["op"] == "quit":
            break
        try:
            reply: dict[str, Any]
            if cmd["op"] == "reset_prefix_cache":
                reply = {"reset": _reset_prefix_cache(llm, float(cmd.get("timeout_s", 60.0)))}
            else:
                reply = _generate(llm, cmd)
        except Exception as exc:
            reply = {"error": repr(exc)}
        print(MARK + json.dumps(reply), flush=True)
    del llm
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m layerlift.testing.vllm_verify")
    sub = parser.add_subparsers(dest="cmd", required=True)
    tiny = sub.add_parser("tiny", help="write a tiny random model")
    tiny.add_argument("kind", choices=("gemma3", "llama", "nemotron_h"))
    tiny.add_argument("path")
    serve = sub.add_parser("serve", help="serve prompts given as JSON lines on stdin")
    serve.add_argument("--model", required=True)
    serve.add_argument("--connector", default="none", choices=("layerlift", "mooncake", "none"))
    serve.add_argument("--extra", default="{}", help="kv_connector_extra_config as JSON")
    serve.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"),
                       help="the model's dtype (default: float32)")
    serve.add_argument("--max-model-len", type=int, default=4096,
                       help="vLLM's max_model_len (default: 4096)")
    serve.add_argument("--kv-bytes", type=int, default=256 << 20,
                       help="vLLM's KV cache bytes (default: 256 MiB)")
    serve.add_argument("--prefix-caching", action="store_true",
                       help="vLLM's local prefix caching on (default: off)")
    serve.add_argument("--failure-policy", default="", choices=("", "recompute", "fail"),
                       help="kv_load_failure_policy (default: recompute)")
    serve.add_argument("--compute-ms", type=float, default=0.0,
                       help="a forward compute stand-in after each attention layer's wait, "
                            "ms (the connector's StandIn class; default: 0, none)")
    serve.add_argument("--scheduler-cls", default="",
                       help="vLLM's scheduler_cls (async scheduling then off), e.g. "
                            "layerlift.hosts.vllm.LayerLiftScheduler")
    args = parser.parse_args(argv)
    if args.cmd == "tiny":
        make_tiny_model(args.kind, args.path)
        return 0
    return _serve(args)


if __name__ == "__main__":
    sys.exit(main())
