#!/usr/bin/env bash
# Which temperature handling should FlatNCE default to? The small-batch grid (configs/
# compare_small_batch.yaml: vlp-micro, 12288 samples per run, held-out OpenMoji retrieval)
# restricted to FlatNCE, once per temperature mode; `learnable` is the default grid's flatnce row.
#   bash scripts/flatnce_temperature.sh
set -euo pipefail
cd "$(dirname "$0")/.."
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
for mode in "split 0.07" "fixed 0.07"; do
  set -- $mode
  .venv/bin/vlp compare -c configs/compare_small_batch.yaml "grid.losses=[flatnce]" "grid.batch_per_device=[8,32]" \
    loss.name=flatnce loss.temperature=$1 loss.tau=$2 grid.out_dir=runs/flatnce_temperature/$1-tau$2 | tail -8
done
