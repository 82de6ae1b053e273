"""Eval cost: the zero-shot classifier (ImageNet's 1000 classes x 80 OpenAI templates) and the
retrieval embedding of every OpenMoji pair, with vlp's text-padding trim and without it.

    OMP_NUM_THREADS=1 python bench/eval_cost.py           # vlp-demo, 3 rounds (~3 min)
    OMP_NUM_THREADS=1 python bench/eval_cost.py --quick   # 20 classes x 8 templates, 1 round

Same model object both ways: `trim` is build_model's DualEncoder (DualEncoder.trim_text drops the
all-padding token columns on the host, exact for open_clip's causal EOT-pooling text tower);
`no_trim` wraps the same open_clip module with trimming off, i.e. what open_clip's own
encode_text computes. Randomly initialised weights (the cost does not depend on them); one
thread, CPU, fp32; rounds alternate the two. Wall seconds per call, median over rounds, and
the per-round ratio. The classifiers of the two ways are compared too (max abs difference).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench._common import REPO, alternate, figure, header, median, paired_ratio, pin_threads, spread  # noqa: E402


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--model", default="vlp-demo")
    ap.add_argument("--classes", type=int, default=1000)
    ap.add_argument("--templates", type=int, default=80)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args(argv)
    if args.quick:
        args.classes, args.templates, args.rounds = 20, 8, 1
    pin_threads()
    import open_clip
    import torch

    from vlp.config.keys import DataConfig
    from vlp.data.stream import make_loader
    from vlp.eval.retrieval import embed_retrieval
    from vlp.eval.zeroshot import build_classifier, load_templates
    from vlp.config import LossConfig, ModelConfig
    from vlp.data.embedded import prepare_shards
    from vlp.models.model import DualEncoder, build_model

    torch.manual_seed(0)
    trimmed, tokenizer, _, eval_tf = build_model(ModelConfig(name=args.model), LossConfig())
    models = {"trim": trimmed.eval(), "no_trim": DualEncoder(trimmed.clip).eval()}
    classnames = list(open_clip.IMAGENET_CLASSNAMES[:args.classes])
    templates = load_templates("openai")[:args.templates]
    specs = prepare_shards(REPO / ".cache" / "shards" / "openmoji")
    pairs_spec = f"{specs['train']}::{specs['eval']}"
    header(f"eval cost: {args.model}, classifier {len(classnames)} classes x {len(templates)} templates, "
           f"retrieval over the OpenMoji pairs, trim vs no trim")

    classifiers = {}

    def classifier_seconds(name):
        t0 = time.perf_counter()
        classifiers[name] = build_classifier(models[name], tokenizer, classnames, templates, "cpu")
        return time.perf_counter() - t0

    pairs = {}

    def retrieval_seconds(name):
        loader = make_loader(DataConfig(train_shards=pairs_spec, batch_per_device=256, mode="sequential"),
                             transform=eval_tf, tokenize=tokenizer)
        t0 = time.perf_counter()
        img, txt, _ = embed_retrieval(models[name], loader, "cpu", show_progress=False)
        pairs[name] = (txt.shape[0], txt)
        return time.perf_counter() - t0

    with torch.no_grad():
        cls = alternate({n: (lambda n=n: classifier_seconds(n)) for n in models}, args.rounds)
        ret = alternate({n: (lambda n=n: retrieval_seconds(n)) for n in models}, args.rounds)
    n_pairs = pairs["trim"][0]
    for name in models:
        print(f"  classifier {name:8s} {spread(cls[name])} s   retrieval {name:8s} {spread(ret[name])} s "
              f"({n_pairs} pairs)")
        figure(f"eval_classifier_s {name}", median(cls[name]), "s")
        figure(f"eval_retrieval_s_per_1k {name}", median(ret[name]) * 1000 / n_pairs, "s")
    r = paired_ratio(cls["no_trim"], cls["trim"])
    figure("eval_classifier_speedup trim", median(r), "x", f"[{min(r):.3f}..{max(r):.3f}]")
    r = paired_ratio(ret["no_trim"], ret["trim"])
    figure("eval_retrieval_speedup trim", median(r), "x", f"[{min(r):.3f}..{max(r):.3f}]")
    diff = max((classifiers["trim"] - classifiers["no_trim"]).abs().max().item(),
               (pairs["trim"][1] - pairs["no_trim"][1]).abs().max().item())
    figure("eval_trim_max_abs_diff", diff, "", "classifier and caption embeddings, trim vs no trim")


if __name__ == "__main__":
    main()
