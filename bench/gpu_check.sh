#!/usr/bin/env bash
# One prepared check for a machine with an NVIDIA GPU (not runnable on the CPU dev box).
#   bash bench/gpu_check.sh            # from the repository root
# Everything it produces lands in one folder: $OUT if set, else ./gpu_results.
set -uo pipefail
cd "$(dirname "$0")/.."
RES="${OUT:-$PWD/gpu_results}"
mkdir -p "$RES"
exec > >(tee "$RES/gpu_check.log") 2>&1
echo "== $(date -u +%FT%TZ)  $(hostname)"
nvidia-smi | tee "$RES/nvidia-smi.txt" || echo "nvidia-smi failed"

PY="${PYTHON:-python3}"
if [ ! -x .venv-gpu/bin/python ]; then
  "$PY" -m venv --system-site-packages .venv-gpu || { echo "venv failed; using $PY"; }
fi
[ -x .venv-gpu/bin/python ] && PY=.venv-gpu/bin/python
echo "python: $PY ($($PY --version 2>&1))"

if compgen -G ".whl/*.whl" > /dev/null; then
  "$PY" -m pip install --no-index .whl/*.whl 2>&1 | tail -3
fi
"$PY" -m pip install -e . --no-deps 2>&1 | tail -1
"$PY" - <<'PYEOF' | tee "$RES/env.txt"
import torch
print("torch", torch.__version__, "cuda", torch.version.cuda, "available", torch.cuda.is_available())
if torch.cuda.is_available():
    print("device", torch.cuda.get_device_name(0))
try:
    import mooncake  # noqa: F401
    print("mooncake import ok")
except Exception as e:  # noqa: BLE001
    print("mooncake import failed:", e)
PYEOF

export GLOG_minloglevel=2
rc=0
# The gpu-marked tests: the CUDA lane (tests/overlap/test_cuda_lane.py) and the engine's
# device scenarios (tests/engine/test_engine_gpu.py), the same scenarios that run in CI
# on the simulated device (tests/engine/test_simdevice*.py). -rs names every skip.
echo "== pytest -m gpu"
"$PY" -m pytest -m gpu -q -rs -p no:cacheprovider --junitxml="$RES/pytest_gpu.xml" \
  2>&1 | tee "$RES/pytest_gpu.txt"
[ "${PIPESTATUS[0]}" -eq 0 ] || rc=1

echo "== layerlift bench ttft --quick --device cuda"
# On a GPU the forward is ~100x faster than on the CPU box: add a fast emulated link too.
timeout 420 "$PY" -m layerlift.cli bench ttft --quick --device cuda \
  --links "mooncake,emulated:0.1,10,emulated:25,5" --no-progress \
  --json "$RES/ttft_gpu.json" --markdown "$RES/ttft_gpu.md" --plot "$RES/ttft_gpu.png" \
  2>&1 | tee "$RES/ttft_gpu.txt"
[ "${PIPESTATUS[0]}" -eq 0 ] || rc=1
echo "== done rc=$rc; results in $RES"; ls -la "$RES"
exit $rc
