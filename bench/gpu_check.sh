#!/usr/bin/env bash
# One prepared check for a machine with an NVIDIA GPU (not runnable on the CPU dev box).
#   bash bench/gpu_check.sh            # from the repository root
# Everything it produces lands in one folder: $OUT if set, else ./gpu_results.
# Planned for a machine with PyTorch (2.11, CUDA 13) but neither SGLang, vLLM nor
# Mooncake, and no network: first run scripts/gpu_wheels.sh on the dev box (it fills
# .whl/ with pytest, its plugins, hypothesis, anyio, ...) and carry .whl/ along; its
# wheels are installed first. What runs without SGLang, vLLM or Mooncake: the
# engine's device scenarios, the CUDA lane, the SGLang adapter's device path
# (tests/linker/test_sglang_device*.py and bench/device_adapters.py need no SGLang:
# pools shaped like SGLang's, the in-memory store), and whatever gpu-marked host tests
# are collected (tests/hosts/<host>_host is collected only where the host imports);
# vLLM 0.33's end-to-end step runs only where vLLM 0.33 and Mooncake are installed.
# SKIP_TTFT=1 leaves out the engine's TTFT benchmark (the longest step).
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
"$PY" -m pip install -e . --no-deps --no-build-isolation 2>&1 | tail -1
"$PY" - <<'PYEOF' | tee "$RES/env.txt"
import torch
print("torch", torch.__version__, "cuda", torch.version.cuda, "available", torch.cuda.is_available())
if torch.cuda.is_available():
    print("device", torch.cuda.get_device_name(0))
for name in ("mooncake", "sglang", "vllm"):
    try:
        __import__(name)
        print(name, "import ok")
    except Exception as e:  # noqa: BLE001
        print(name, "import failed:", type(e).__name__, e)
PYEOF

export GLOG_minloglevel=2
rc=0
# The gpu-marked tests: the CUDA lane (tests/overlap/test_cuda_lane.py), the engine's
# device scenarios (tests/engine/test_engine_gpu.py), the same scenarios that run in CI
# on the simulated device (tests/engine/test_simdevice*.py), the staged transfer's and
# the adapters' device paths (tests/overlap/test_staged_device.py,
# tests/linker/test_sglang_device.py; a host's own folder only where it imports).
# -rs names every skip.
echo "== pytest -m gpu"
"$PY" -c "import hypothesis" 2>/dev/null || echo "WARNING: hypothesis does not import: pytest stops at the collection errors of the modules that use it (run scripts/gpu_wheels.sh on the dev box, carry .whl/)"
"$PY" -m pytest -m gpu -q -rs -p no:cacheprovider --junitxml="$RES/pytest_gpu.xml" \
  2>&1 | tee "$RES/pytest_gpu.txt"
[ "${PIPESTATUS[0]}" -eq 0 ] || rc=1

# The adapters' device paths: the SGLang adapter's load (DeviceSink on a load stream, one
# event per layer the forward stream waits on), its zeroing of a failed layer and its
# offload gather; the vLLM worker's loads (wait_for_layer_load on the layer's event),
# its late layers and its saves ordered after the forward. On CUDA and on the simulated
# device with the negative controls; neither file imports its host, and the one
# Mooncake test of the vLLM file is left out (no Mooncake on the GPU machine).
echo "== adapters' device paths (simulated device + CUDA)"
"$PY" -m pytest -q -rs -p no:cacheprovider --junitxml="$RES/pytest_adapters.xml" \
  -m "not mooncake" \
  tests/linker/test_sglang_device.py tests/linker/test_sglang_device_bench.py \
  tests/hosts/vllm_host/test_vllm_device.py \
  2>&1 | tee "$RES/pytest_adapters.txt"
[ "${PIPESTATUS[0]}" -eq 0 ] || rc=1

# vLLM 0.33 (the GPU release) end to end: a new instance restores a tiny llama
# (one KV cache group) and a tiny gemma3 (sliding + full, LayerLiftScheduler) on CUDA
# and answers as a cold one (tests/hosts/vllm033_host/test_vllm033_gpu.py), then
# the 0.33 unit tests. Only where vLLM 0.33 and Mooncake import: this script installs
# neither (no network), so elsewhere the step says why and is left out.
echo "== vLLM 0.33 end to end (tests/hosts/vllm033_host)"
if "$PY" -c 'import vllm, mooncake.store; assert vllm.__version__.startswith("0.33."), vllm.__version__' \
    > "$RES/vllm033_probe.txt" 2>&1; then
  LAYERLIFT_HOST_TESTS=vllm033 timeout 1800 "$PY" -m pytest -q -rs -p no:cacheprovider \
    --junitxml="$RES/pytest_vllm033.xml" -m vllm033 tests/hosts/vllm033_host \
    2>&1 | tee "$RES/pytest_vllm033.txt"
  [ "${PIPESTATUS[0]}" -eq 0 ] || rc=1
else
  echo "left out: vLLM 0.33 and Mooncake do not both import here ($(tail -1 "$RES/vllm033_probe.txt"))"
fi

# Per-layer H2D from pinned staging, the forward's wait per layer, per-layer overlap
# against a whole-batch wait (bench/device_adapters.py's docstring), 32 layers x 16 MiB.
echo "== python -m layerlift.bench.device_adapters --device cuda"
timeout 240 "$PY" -m layerlift.bench.device_adapters --device cuda \
  --json "$RES/device_adapters.json" --markdown "$RES/device_adapters.md" \
  2>&1 | tee "$RES/device_adapters.txt"
[ "${PIPESTATUS[0]}" -eq 0 ] || rc=1

if [ "${SKIP_TTFT:-0}" = 1 ]; then
  echo "== done rc=$rc; results in $RES (SKIP_TTFT=1)"; ls -la "$RES"
  exit $rc
fi

echo "== layerlift bench ttft --quick --device cuda"
# On a GPU the forward is ~100x faster than on the CPU box: add a fast emulated link too.
timeout 420 "$PY" -m layerlift.cli bench ttft --quick --device cuda \
  --links "mooncake,emulated:0.1,10,emulated:25,5" --no-progress \
  --json "$RES/ttft_gpu.json" --markdown "$RES/ttft_gpu.md" --plot "$RES/ttft_gpu.png" \
  2>&1 | tee "$RES/ttft_gpu.txt"
[ "${PIPESTATUS[0]}" -eq 0 ] || rc=1
echo "== done rc=$rc; results in $RES"; ls -la "$RES"
exit $rc
