#!/usr/bin/env bash
# Idempotent set-up of .venv-sglang: SGLang 0.5.23's cache code on CPU, for the
# tests marked `sglang` (tests/hosts/sglang_host) and `layerlift bench sglang`.
#   - SGLang itself without its dependencies (its full set pulls CUDA kernels:
#     flashinfer, sglang-kernel, deep-ep, ...), then only the pure-Python
#     modules the import chain of its unified cache, pools and linkers needs.
#   - torch==2.14.1 + torchvision==0.29.1 (SGLang's pins; a CUDA build that runs
#     on CPU; sglang.srt.configs imports torchvision).
#   - LayerLift editable with the Mooncake CPU extra and the test tools.
# Fast when already built: every step checks first.
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python3.11}"
command -v "$PY" >/dev/null || PY=python3
VENV=.venv-sglang
VPY="$VENV/bin/python"
STAMP="$VENV/.layerlift-sglang-installed"

# The libraries the Mooncake wheel links (as scripts/setup.sh).
APT=()
ldconfig -p 2>/dev/null | grep -q 'libibverbs.so.1' || APT+=(libibverbs1 ibverbs-providers)
ldconfig -p 2>/dev/null | grep -q 'libnuma.so.1' || APT+=(libnuma1)
ldconfig -p 2>/dev/null | grep -q 'libcurl.so.4' || APT+=(libcurl4)
if [ "${#APT[@]}" -gt 0 ]; then
  SUDO=""; [ "$(id -u)" -ne 0 ] && SUDO="sudo"
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq "${APT[@]}" >/dev/null
fi

if [ -f "$STAMP" ] && [ ! pyproject.toml -nt "$STAMP" ] && [ ! "$0" -nt "$STAMP" ] \
   && "$VPY" -c 'import layerlift, mooncake.store, sglang.srt.mem_cache.unified_radix_cache' 2>/dev/null; then
  exit 0
fi

[ -x "$VPY" ] || "$PY" -m venv "$VENV"
PIP=("$VPY" -m pip install -q)
if ! "$VPY" -c 'import torch, torchvision; assert torch.__version__.startswith("2.14.1")' 2>/dev/null; then
  "$VPY" -m pip install -q --upgrade pip
  "${PIP[@]}" torch==2.14.1 torchvision==0.29.1
fi
# SGLang's modules, and those its import chain needs that have no native CUDA part.
"${PIP[@]}" --no-deps sglang==0.5.23 compressed-tensors==0.18.0 triton \
  partial_json_parser gguf
"${PIP[@]}" orjson psutil pybase64 requests packaging pillow starlette msgspec \
  pydantic pyzmq tqdm ipython aiohttp "transformers==5.19.0" dill \
  "apache-tvm-ffi==0.1.11" "sentencepiece==0.2.1" loguru "openai==2.8.0" sniffio
"${PIP[@]}" -e ".[cpu]" pytest pytest-asyncio pytest-timeout hypothesis
touch "$STAMP"
