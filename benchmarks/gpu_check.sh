#!/usr/bin/env bash
# On a machine with an NVIDIA GPU: the CUDA/NCCL paths and figures, compare.py on the GPU, and with 2+ GPUs tensor parallel.
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
# regional vs whole-model compile on the GPU (fresh processes, cold inductor caches)
comp=0
echo
"$PY" benchmarks/compile.py --layers 4 8 --no-ranks || comp=$?
# tensor parallel needs a second GPU (NCCL cannot put two ranks on one device)
tp=0
gpus=$("$PY" -c 'import torch; print(torch.cuda.device_count())')
echo
if [ "$gpus" -ge 2 ]; then
  "${TORCHRUN:-.venv/bin/torchrun}" --standalone --nproc_per_node=2 benchmarks/tp_check.py || tp=$?
else
  echo "tensor parallel row: skipped, $gpus CUDA device(s) here (tp_check.py needs 2)"
fi
# the test tier that needs a GPU (tests/gpu, the gpu marker)
gputests=0
echo
"$PY" -m pytest -q -m gpu tests/gpu || gputests=$?
if [ "$check" -ne 0 ] || [ "$compare" -ne 0 ] || [ "$tp" -ne 0 ] || [ "$comp" -ne 0 ] || [ "$gputests" -ne 0 ]; then
  echo "gpu_check.sh: gpu_check.py exited $check, compare.py exited $compare, tp_check.py exited $tp, compile.py exited $comp, tests/gpu exited $gputests" >&2
  exit 1
fi
