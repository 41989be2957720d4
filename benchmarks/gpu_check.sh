#!/usr/bin/env bash
# On a machine with one NVIDIA GPU: the CUDA/NCCL paths and figures, as a short table.
# Needs the project installed with a CUDA build of torch (install torch first, then pip install -e .).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
"$PY" benchmarks/gpu_check.py
