"""Held-out retrieval quality: vlp (InfoNCE, learnable temperature) vs open_clip_train.

    OMP_NUM_THREADS=1 python bench/quality.py           # vlp-tiny, 12,800 samples/run, 2 seeds (~8 min)
    OMP_NUM_THREADS=1 python bench/quality.py --quick   # vlp-micro, 384 samples, 1 seed

Same model config (vlp-tiny), same OpenMoji train shards (vlp.data.embedded.prepare_shards),
same per-device batch (64), samples seen, optimiser (AdamW lr 1e-3, wd 0.1, betas 0.9/0.98,
eps 1e-6, 50 warmup steps, cosine), fp32, 1 process, 1 worker, seeds 0 and 1. Only the
trainers differ (and with them the data order: each has its own shuffler).

Both final weights are evaluated by the same code: vlp.eval.checkpoints.load_model_from_checkpoint
(vlp: the exported open_clip_model.pt; open_clip_train: checkpoints/epoch_1.pt, its
state_dict) then vlp.eval.suite.run_eval_suite on the held-out OpenMoji eval shards (names never
seen in training): R@1 image->text and text->image, and their mean.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench._common import REPO, bench_env, figure, header, pin_threads, run  # noqa: E402
from bench.train_throughput import open_clip_cmd, vlp_cmd  # noqa: E402


def evaluate(weights: Path, model: str, eval_spec: str) -> dict:
    from vlp.eval.suite import run_eval_suite
    from vlp.eval.checkpoints import load_model_from_checkpoint

    net, tokenizer, eval_tf = load_model_from_checkpoint(str(weights), model_name=model)
    suite = {"batch_size": 256, "retrieval": [{"name": "openmoji_eval", "shards": eval_spec}]}
    res = run_eval_suite(net, tokenizer, eval_tf, suite, "cpu", None, show_progress=False)
    return res["openmoji_eval"]["metrics"]


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--model", default="vlp-tiny")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--samples", type=int, default=12800, help="samples seen per run")
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    ap.add_argument("--workers", type=int, default=1)
    ap.add_argument("--warmup", type=int, default=50, help="LR warmup steps")
    args = ap.parse_args(argv)
    if args.quick:
        args.model, args.samples, args.seeds, args.warmup = "vlp-micro", 384, [0], 2
    pin_threads()
    steps = args.samples // args.batch
    header(f"quality: {args.model}, batch {args.batch}, {steps * args.batch} samples/run ({steps} steps), "
           f"seeds {args.seeds}")
    from vlp.data.embedded import prepare_shards

    specs = prepare_shards(REPO / ".cache" / "shards" / "openmoji")
    rows = []
    with tempfile.TemporaryDirectory(prefix="bench_quality_") as tmp:
        tmp = Path(tmp)
        for seed in args.seeds:
            for system in ("vlp", "open_clip_train"):
                out = tmp / f"{system}_{seed}"
                if system == "vlp":
                    cmd = vlp_cmd(specs["train"], out, args.model, args.batch, steps, args.workers,
                                  seed=seed, lr=1e-3, warmup=args.warmup,
                                  extra=["train.log_every=20", "data.shuffle_buffer=2000"])
                    weights = out / "open_clip_model.pt"
                else:
                    cmd = open_clip_cmd(specs["train"], out, args.model, args.batch, steps, args.workers,
                                        seed=seed, lr=1e-3, warmup=args.warmup,
                                        extra=["--log-every-n-steps", "20"])
                    weights = out / "run" / "checkpoints" / "epoch_1.pt"
                wall, _ = run(cmd, env=bench_env())
                m = evaluate(weights, args.model, specs["eval"])
                row = {"system": system, "seed": seed, "wall_s": wall,
                       "i2t": m["image_to_text_R@1"], "t2i": m["text_to_image_R@1"]}
                row["mean"] = (row["i2t"] + row["t2i"]) / 2
                rows.append(row)
                print(f"  {system:16s} seed {seed}: R@1 image->text {100 * row['i2t']:5.1f}  "
                      f"text->image {100 * row['t2i']:5.1f}  ({wall:.0f} s incl. startup)", flush=True)
    print("\n| system | seeds | image→text R@1 | text→image R@1 | mean R@1 |\n|---|---|---|---|---|")
    means = {}
    for system in ("vlp", "open_clip_train"):
        rs = [r for r in rows if r["system"] == system]
        agg = {k: statistics.mean(r[k] for r in rs) for k in ("i2t", "t2i", "mean")}
        means[system] = agg["mean"]
        print(f"| {system} | {len(rs)} | {100 * agg['i2t']:.1f} | {100 * agg['t2i']:.1f} | {100 * agg['mean']:.1f} |")
        figure(f"quality_mean_R@1 {system}", 100 * agg["mean"], "%")
    figure("quality_ratio vlp/open_clip_train", means["vlp"] / max(means["open_clip_train"], 1e-9), "x",
           "mean R@1 over both directions and seeds")


if __name__ == "__main__":
    main()
