#!/usr/bin/env bash
# GPU check of the model service, every GPU test and benchmark in one go: on a machine with an NVIDIA GPU,
# install what is missing (torch's CUDA build and TensorRT at pyproject.toml's pins), run the backend tests
# (tests/gpu: TensorRT, torch on CUDA and ONNX Runtime's CUDA provider give the CPU's answers at FP32 and FP16;
# engines built and cached; a .plan served as it is; TensorRT failing on an operator and torch on the GPU
# taking the model, or the load failing when strict), the runner fallback and quantization tests, then
# benchmark the runners on the GPU and on the CPU (python -m bench.runners at batch 1, 8, 16, 32, 128:
# TensorRT FP32, FP16 and INT8, torch FP32 and FP16, ONNX Runtime; and ResNet-18 at batch 16) and INT8 against
# FP32 on the CPU (python -m bench.quantize).
#
#   bash scripts/gpu-check.sh               # from the repository root
#
# Environment: PYTHON (default .venv/bin/python, else python3), SECONDS_PER_FIGURE (default 2), OUT (where
# figures and logs go; default gpu-check-out), INSTALL=0 to install nothing (use what is there).
set -euo pipefail
cd "$(dirname "$0")/.."

OUT=${OUT:-gpu-check-out}
SECONDS_PER_FIGURE=${SECONDS_PER_FIGURE:-2}
INSTALL=${INSTALL:-1}
if [[ -z "${PYTHON:-}" ]]; then
  if [[ -x .venv/bin/python ]]; then PYTHON=.venv/bin/python; else PYTHON=python3; fi
fi
mkdir -p "$OUT"

echo "== machine"
nvidia-smi --query-gpu=index,name,memory.total,driver_version --format=csv,noheader || echo "nvidia-smi: none"

have() { "$PYTHON" -c "import $1" >/dev/null 2>&1; }

if [[ "$INSTALL" == 1 ]]; then
  echo "== installing what is missing"
  # The project itself, with its test extras, when it is not installed yet.
  have pipeline || "$PYTHON" -m pip install --quiet -e ".[test]" || echo "cannot install the project"
  # torch must be a CUDA build: the pinned CPU wheel cannot see the GPU. Keep the version the project pins.
  if ! "$PYTHON" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then
    version=$("$PYTHON" -c "import torch; print(torch.__version__.split('+')[0])")
    echo "torch $version cannot see a GPU; installing its CUDA build (PyPI's Linux wheel is one)"
    # PyPI's own index (a local CPU wheel must not win), with the CUDA libraries the wheel depends on.
    { "$PYTHON" -m pip install --quiet --force-reinstall --no-deps --index-url https://pypi.org/simple "torch==$version" \
      && "$PYTHON" -m pip install --quiet --index-url https://pypi.org/simple "torch==$version"; } \
      || echo "no CUDA build of torch could be installed: GPU figures will be missing"
  fi
  # TensorRT's libraries are wheels on NVIDIA's index (PyPI has the packages that fetch them).
  have tensorrt || "$PYTHON" -m pip install --quiet --extra-index-url https://pypi.nvidia.com \
    $("$PYTHON" docker/requirements.py pyproject.toml --extra gpu) || echo "tensorrt did not install: TensorRT is skipped"
fi

"$PYTHON" - <<'PY'
import torch
from services.model.tensorrt import tensorrt_status
print(f"torch {torch.__version__}, CUDA available: {torch.cuda.is_available()}",
      f"({torch.cuda.get_device_name(0)})" if torch.cuda.is_available() else "")
print("TensorRT:", tensorrt_status()[1])
PY

echo "== backend tests (tests/gpu), then the model tests: fallback, quantization, runner choice"
status=0
"$PYTHON" -m pytest -q -rs tests/gpu tests/unit/test_model_backends.py tests/integration/test_runner_fallback.py \
  tests/integration/test_quantize.py 2>&1 | tee "$OUT/tests.log" || status=$?

echo "== benchmark: the runners alone, items/s"
for device in cuda:0 cpu; do
  "$PYTHON" -m bench.runners --device "$device" --batches 1 8 16 32 128 --seconds "$SECONDS_PER_FIGURE" \
    --json "$OUT/bench-${device/:/}.json" 2>&1 | tee "$OUT/bench-${device/:/}.log" || status=$?
done

echo "== benchmark: ResNet-18 at batch 16 on the GPU (TensorRT FP16 against torch eager, INT8 against FP16)"
"$PYTHON" -m bench.runners --device cuda:0 --network resnet18 --batches 16 --seconds "$SECONDS_PER_FIGURE" \
  --json "$OUT/bench-resnet18-cuda0.json" 2>&1 | tee "$OUT/bench-resnet18-cuda0.log" || status=$?

echo "== benchmark: INT8 against FP32 on the CPU (pipeline quantize)"
"$PYTHON" -m bench.quantize 2>&1 | tee "$OUT/bench-quantize.log" || status=$?
echo "== done: tests and figures in $OUT (exit $status)"
exit "$status"
