#!/usr/bin/env bash
# Idempotent set-up for a fresh machine (run as root, or with sudo available):
#   - Debian's libibverbs1 + ibverbs-providers, libnuma1, libcurl4 (the Mooncake
#     wheel links them) and iproute2 (network-namespace tests), when missing
#   - a virtual environment .venv in the repo root
#   - torch (the local CPU wheel on these machines: torch==2.13.0), then
#     LayerLift editable with its Mooncake extra, the dev tools and the `hf`
#     extra (transformers, for TransformersModel and its tests).
# LAYERLIFT_EXTRA=cpu|cuda|cuda13 picks the Mooncake wheel (never two).
set -euo pipefail
cd "$(dirname "$0")/.."
EXTRA="${LAYERLIFT_EXTRA:-cpu}"
PY="${PYTHON:-python3}"

# Debian packages: the libraries the Mooncake wheel links, and iproute2 (ip,
# tc, ss) for the network-namespace tests and the netns benchmark link.
APT=()
ldconfig -p 2>/dev/null | grep -q 'libibverbs.so.1' || APT+=(libibverbs1 ibverbs-providers)
ldconfig -p 2>/dev/null | grep -q 'libnuma.so.1' || APT+=(libnuma1)
ldconfig -p 2>/dev/null | grep -q 'libcurl.so.4' || APT+=(libcurl4)
command -v ip >/dev/null && command -v tc >/dev/null || APT+=(iproute2)
if [ "${#APT[@]}" -gt 0 ]; then
  SUDO=""; [ "$(id -u)" -ne 0 ] && SUDO="sudo"
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq "${APT[@]}" >/dev/null
fi

[ -x .venv/bin/python ] || "$PY" -m venv .venv
VPY=.venv/bin/python
if ! "$VPY" -c 'import torch' 2>/dev/null; then
  "$VPY" -m pip install -q --upgrade pip
  "$VPY" -m pip install -q "torch==${LAYERLIFT_TORCH:-2.13.0}"
fi
if ! "$VPY" -c 'import layerlift, mooncake.store, pytest, hypothesis, transformers' 2>/dev/null \
   || [ pyproject.toml -nt .venv/.layerlift-installed ]; then
  "$VPY" -m pip install -q -e ".[${EXTRA},dev,hf]"
  touch .venv/.layerlift-installed
fi
