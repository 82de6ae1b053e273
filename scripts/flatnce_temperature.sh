#!/usr/bin/env bash
# Which temperature handling should FlatNCE default to? Trains the demo model with FlatNCE under
# each mode (same seed, data order and sample budget) and prints held-out retrieval.
#   bash scripts/flatnce_temperature.sh [samples]      # default 40000 = the demo's budget
set -euo pipefail
cd "$(dirname "$0")/.."
SAMPLES=${1:-40000}
OUT=runs/flatnce_temperature
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-2}
.venv/bin/python - <<'PY'
from pathlib import Path
from vlp.demo import prepare_openmoji_shards
prepare_openmoji_shards(Path(".cache/shards/openmoji"))
PY
SPEC_TRAIN=$(.venv/bin/python -c "from data_pipelines.write import shard_spec; print(shard_spec('.cache/shards/openmoji/train', prefix='train'))")
SPEC_EVAL=$(.venv/bin/python -c "from data_pipelines.write import shard_spec; print(shard_spec('.cache/shards/openmoji/eval', prefix='eval'))")
for mode in "learnable 0.07" "infonce 0.07" "fixed 0.07" "fixed 0.03"; do
  set -- $mode
  name="$1-tau$2"
  [ -f "$OUT/$name/result.json" ] && continue
  .venv/bin/vlp train -c configs/demo.yaml loss.name=flatnce loss.temperature=$1 loss.tau=$2 \
    train.samples=$SAMPLES "data.train_shards=$SPEC_TRAIN" "data.eval_shards=$SPEC_EVAL" \
    train.output_dir=$OUT/$name 2>/dev/null | tail -1
done
.venv/bin/python - "$OUT" <<'PY'
import json, sys
from pathlib import Path
print("| FlatNCE temperature | final logit_scale | i→t R@1 | t→i R@1 | mean R@1 |")
print("|---|---|---|---|---|")
for run in sorted(Path(sys.argv[1]).iterdir()):
    r = json.loads((run / "result.json").read_text())
    last = [json.loads(x) for x in (run / "log.jsonl").read_text().splitlines() if '"logit_scale"' in x][-1]
    i2t, t2i = r["eval/image_to_text_R@1"], r["eval/text_to_image_R@1"]
    print(f"| {run.name} | {last['logit_scale']:.1f} | {100*i2t:.1f} | {100*t2i:.1f} | {50*(i2t+t2i):.1f} |")
PY
