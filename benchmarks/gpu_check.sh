#!/usr/bin/env bash
# On a machine with one NVIDIA GPU: the CUDA/NCCL paths and figures, then compare.py on the GPU; two tables.
# Needs the project installed with a CUDA build of torch and the bench extra
# (install torch first, then pip install -e '.[bench]'). Exits 2 without CUDA, 1 if either part failed.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
check=0
"$PY" benchmarks/gpu_check.py || check=$?
if [ "$check" -eq 2 ]; then
  echo "gpu_check.sh: no CUDA device here (gpu_check.py exited 2); nothing else run" >&2
  exit 2
fi
echo
# every row, 12 rounds of 4 batches: by estimate 2-3 minutes on an H200, mostly the 24 fresh
# worker processes (not yet run on a GPU)
compare=0
"$PY" benchmarks/compare.py --device cuda --quick --rounds 12 --steps 4 || compare=$?
if [ "$check" -ne 0 ] || [ "$compare" -ne 0 ]; then
  echo "gpu_check.sh: gpu_check.py exited $check, compare.py exited $compare" >&2
  exit 1
fi
