#!/usr/bin/env bash
# Idempotent set-up of .venv-sglang: SGLang 0.5.23's cache code on CPU, for the
# tests marked `sglang` (tests/hosts/sglang_host) and `layerlift bench sglang`.
# Run as root (or with sudo) on a fresh Debian machine; fast when already built.
#   - Debian: the libraries the Mooncake wheel links (as scripts/setup.sh), and
#     g++ + libssl-dev: SGLang hashes pages with a C++ extension it compiles on
#     first use (torch cpp_extension, -lcrypto); this script compiles it once.
#   - torch==2.14.1 + torchvision==0.29.1 (SGLang's pins; a CUDA build that runs
#     on CPU; sglang.srt.configs imports torchvision).
#   - SGLang itself without its dependencies (its full set pulls CUDA kernels:
#     flashinfer, sglang-kernel, deep-ep, ...), then only the pure-Python
#     modules the import chain of its unified cache, pools and linkers needs.
#   - LayerLift editable with the Mooncake CPU extra and the test tools.
# LAYERLIFT_SGLANG_VENV picks another folder (default .venv-sglang).
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python3.11}"
command -v "$PY" >/dev/null || PY=python3
VENV="${LAYERLIFT_SGLANG_VENV:-.venv-sglang}"
VPY="$VENV/bin/python"
STAMP="$VENV/.layerlift-sglang-installed"
CHECK='import layerlift.hosts.sglang, mooncake.store, pytest, pytest_asyncio, hypothesis
from sglang.srt.mem_cache.utils import get_hash_str
get_hash_str([1, 2, 3, 4], None, page_size=2)'

APT=()
ldconfig -p 2>/dev/null | grep -q 'libibverbs.so.1' || APT+=(libibverbs1 ibverbs-providers)
ldconfig -p 2>/dev/null | grep -q 'libnuma.so.1' || APT+=(libnuma1)
ldconfig -p 2>/dev/null | grep -q 'libcurl.so.4' || APT+=(libcurl4)
command -v g++ >/dev/null || APT+=(g++)
[ -f /usr/include/openssl/sha.h ] || APT+=(libssl-dev)
if [ "${#APT[@]}" -gt 0 ]; then
  SUDO=""; [ "$(id -u)" -ne 0 ] && SUDO="sudo"
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq "${APT[@]}" >/dev/null
fi

if [ -f "$STAMP" ] && [ ! pyproject.toml -nt "$STAMP" ] && [ ! "$0" -nt "$STAMP" ] \
   && "$VPY" -c "$CHECK" >/dev/null 2>&1; then
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
  pydantic pyzmq tqdm ipython aiohttp "transformers==5.19.0" "tokenizers==0.23.2" dill ninja \
  "apache-tvm-ffi==0.1.11" "sentencepiece==0.2.1" loguru "openai==2.8.0" sniffio
"${PIP[@]}" -e ".[cpu]" pytest pytest-asyncio pytest-timeout hypothesis
# Compile SGLang's page-hash extension now (needs the venv's ninja on PATH), not in a test.
if ! PATH="$VENV/bin:$PATH" "$VPY" -c "$CHECK" >/dev/null 2>&1; then
  PATH="$VENV/bin:$PATH" "$VPY" -c "$CHECK"  # show why
  exit 1
fi
touch "$STAMP"
