#!/usr/bin/env bash
# One-GPU benchmark (bench/gpu_bench.py) on a box that has torch + accelerate + transformers + timm
# but neither open_clip_torch nor webdataset, and no internet.
#
# Before (on a machine with PyPI access, from the repo root), fetch the wheels it installs:
#   pip download open_clip_torch==3.3.0 webdataset==0.2.86 ftfy==6.3.1 wcwidth==0.9.4 \
#       braceexpand==0.1.7 --no-deps -d bench/wheels
#   for v in 3.10 3.11 3.12 3.13; do        # regex is compiled: one wheel per CPython version
#     pip download regex --no-deps --only-binary=:all: --python-version $v \
#         --platform manylinux2014_x86_64 -d bench/wheels; done   # (3.10: an older regex)
# bench/wheels/ is git-ignored (bench/.gitignore): carry it to the box explicitly
# (e.g. the device runner's carry=["bench/wheels"]); never commit it.
#
# On the box (repo root; results under $OUT or runs/gpu_bench), one run of at most 8 min on one H200:
#   bash bench/gpu.sh                 # sweep + CLI + compiled runs (<= 340 s), then gpu_bench.py (the rest of 460 s)
#   bash bench/gpu.sh --skip-real     # gpu_bench.py's synthetic section only (the sweep still runs)
# 1. bench/gpu_sweep.py: per-GPU batch 8, 32, 128, 256; at each, vlp eager, vlp with
#    train.cuda_graphs, open_clip_train and a bare loop side by side (+ train.compile=true with and
#    without graphs at 32 and 256): ms/step, samples/s, MFU, peak memory. Then `vlp train -c
#    configs/gpu_vitb32.yaml` for 150 steps on real JPEG shards, eager and with graphs.
# 2. bench/gpu_bench.py: real JPEG shards (data.decode=cpu and data.decode=gpu: nvjpeg with its
#    fallback counts), host syncs per train step (counted reads + torch.cuda.set_sync_debug_mode).
# Time limits: SWEEP_S for the sweep, TOTAL_S for the whole (gpu_bench.py gets what is left).
# CPU smoke runs (tests/test_bench_smoke.py): python bench/gpu_sweep.py --cpu --tiny --cli-steps 3;
# python bench/gpu_bench.py --cpu --tiny
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python}
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1} PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export TOKENIZERS_PARALLELISM=false PYTHONUNBUFFERED=1

if ! $PY -c "import open_clip, open_clip_train, webdataset, ftfy, regex, braceexpand" 2>/dev/null; then
  if ! ls bench/wheels/*.whl >/dev/null 2>&1; then
    echo "gpu.sh: open_clip_torch/webdataset missing and no wheels in bench/wheels (see the header)" >&2
    exit 2
  fi
  # --no-index + --find-links lets pip pick the regex wheel that matches this Python
  $PY -m pip install --quiet --no-deps --no-index --find-links bench/wheels \
      open_clip_torch webdataset ftfy wcwidth regex braceexpand
fi
$PY - <<'PY'
import importlib, sys
missing = [m for m in ("torch", "accelerate", "open_clip", "open_clip_train", "webdataset", "yaml",
                       "tqdm", "PIL", "numpy", "braceexpand", "ftfy", "regex") if importlib.util.find_spec(m) is None]
if missing:
    sys.exit(f"gpu.sh: missing modules {missing}")
import torch
print(f"# torch {torch.__version__}, cuda {torch.version.cuda}, "
      f"{torch.cuda.get_device_name(0) if torch.cuda.is_available() else 'no GPU'}", flush=True)
PY
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm,power.limit --format=csv 2>/dev/null || true
# one run of at most TOTAL_S (8 min): the sweep first (up to SWEEP_S), gpu_bench.py gets the rest
status=0 start=$SECONDS
timeout "${SWEEP_S:-340}" $PY bench/gpu_sweep.py --cli-steps 150 ${SWEEP_ARGS:-} || status=$?
left=$(( ${TOTAL_S:-460} - (SECONDS - start) ))
if [ "$left" -ge 60 ]; then
  timeout "$left" $PY bench/gpu_bench.py --rounds 1 "$@" || status=$?
else
  echo "gpu.sh: ${left} s left: bench/gpu_bench.py skipped" >&2
fi
exit $status
