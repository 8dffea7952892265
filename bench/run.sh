#!/usr/bin/env bash
# Compare the refcnn workload: in-process PyTorch (the ceiling), the pipeline with batching OFF, then ON.
# Usage: bench/run.sh RESULTS_DIR [--duration S] [--warmup S] [--peers DIR]   (about 3 minutes with the defaults)
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-.venv/bin/python}"
exec "$PYTHON" -m bench.compare "$@"
