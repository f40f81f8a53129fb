#!/usr/bin/env bash
# The transformers architecture tests under each set of CPU kernels ATen can
# dispatch to (ATEN_CPU_CAPABILITY), so that no exactness oracle depends on the
# kernels of the machine it runs on (a float32 MoE routing decision flipped
# between the avx2/avx512 kernels and the default ones).
#
#   scripts/test_kernels.sh [SET ...] [-- PYTEST_OPTIONS ...]
#
# SET: default (no SIMD), avx2, avx512, or own (the machine's best: the
# variable unset). Without a SET: default, avx2 and own on x86-64; default and
# own elsewhere. "others": those but own (for after a plain pytest run, which
# ran the machine's own). A set this CPU cannot run is an error (torch would
# silently run another one); a set whose kernels already ran is skipped.
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-.venv/bin/python}"
TESTS=(tests/engine/model/test_model_hf_archs.py)

# the kernel set torch dispatches to under ATEN_CPU_CAPABILITY=$1 ("own": unset)
effective() {
  local code='import torch; print(torch.backends.cpu.get_cpu_capability().lower())'
  if [[ "$1" == own ]]; then
    env -u ATEN_CPU_CAPABILITY "$PY" -W ignore -c "$code"
  else
    ATEN_CPU_CAPABILITY="$1" "$PY" -W ignore -c "$code"
  fi
}

sets=()
while (($#)); do
  if [[ "$1" == "--" ]]; then shift; break; fi
  case "$1" in
    default|avx2|avx512|own|others) sets+=("$1"); shift ;;
    *) echo "test_kernels.sh: unknown kernel set '$1' (default, avx2, avx512, own or others)" >&2
       exit 2 ;;
  esac
done
declare -A done_sets=()
if [[ "${sets[*]-}" == others ]]; then
  sets=()
  done_sets[$(effective own)]=1
fi
if ((${#sets[@]} == 0)); then
  sets=(default)
  if [[ "$(uname -m)" == x86_64 ]]; then sets+=(avx2); fi
  if ((${#done_sets[@]} == 0)); then sets+=(own); fi
fi

for set in "${sets[@]}"; do
  if [[ "$set" == others ]]; then
    echo "test_kernels.sh: 'others' stands alone (every set but the machine's own)" >&2
    exit 2
  fi
  got="$(effective "$set")"
  if [[ "$set" != own && "$got" != "$set" ]]; then
    echo "test_kernels.sh: this CPU cannot run the $set kernels (torch runs $got)" >&2
    exit 2
  fi
  if [[ -n "${done_sets[$got]:-}" ]]; then
    echo "== $set: the $got kernels already ran, skipped"
    continue
  fi
  done_sets[$got]=1
  echo "== ATEN_CPU_CAPABILITY=$set ($got kernels): ${TESTS[*]}"
  if [[ "$set" == own ]]; then
    env -u ATEN_CPU_CAPABILITY "$PY" -m pytest -q "${TESTS[@]}" "$@"
  else
    ATEN_CPU_CAPABILITY="$set" "$PY" -m pytest -q "${TESTS[@]}" "$@"
  fi
done
