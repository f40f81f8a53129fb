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
# own elsewhere. A set this CPU cannot run is an error (torch would silently
# run another one); a set whose kernels were already run is skipped with a note.
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-.venv/bin/python}"
TESTS=(tests/engine/model/test_model_hf_archs.py)

sets=()
while (($#)); do
  if [[ "$1" == "--" ]]; then shift; break; fi
  sets+=("$1"); shift
done
if ((${#sets[@]} == 0)); then
  if [[ "$(uname -m)" == x86_64 ]]; then sets=(default avx2 own); else sets=(default own); fi
fi

# the kernel set torch dispatches to under ATEN_CPU_CAPABILITY=$1 ("own": unset)
effective() {
  local code='import torch; print(torch.backends.cpu.get_cpu_capability().lower())'
  if [[ "$1" == own ]]; then
    env -u ATEN_CPU_CAPABILITY "$PY" -W ignore -c "$code"
  else
    ATEN_CPU_CAPABILITY="$1" "$PY" -W ignore -c "$code"
  fi
}

declare -A done_sets=()
for set in "${sets[@]}"; do
  case "$set" in
    default|avx2|avx512|own) ;;
    *) echo "test_kernels.sh: unknown kernel set '$set' (default, avx2, avx512 or own)" >&2
       exit 2 ;;
  esac
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
