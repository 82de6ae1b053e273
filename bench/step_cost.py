"""Training-step cost of each loss at global batch 1024 on CPU, measured side by side.

One step = encoders forward, loss (with its diagnostics), backward, fused AdamW step: what
`Trainer.train_step` does on one process. The loss variants alternate within each round
(rotated order), each round keeps the fastest of --steps steps (least disturbed by other
processes), the per-round ratio to InfoNCE is taken side by side, and the median over rounds
is reported. Timed by this thread's CPU clock (with one OpenMP thread the forward, the CPU
autograd backward and the optimizer all run on it; --clock wall for perf_counter).
Complements bench/loss_cost.py, which times the loss alone.

    OMP_NUM_THREADS=1 .venv/bin/python bench/step_cost.py            # ~1 min
    OMP_NUM_THREADS=1 .venv/bin/python bench/step_cost.py --quick    # smoke test
"""

from __future__ import annotations

import argparse
import time
from statistics import median

import torch

VARIANTS = {  # name: (loss, temperature)
    "infonce": ("infonce", "learnable"),
    "flatnce": ("flatnce", "learnable"),
    "flatnce_t_infonce": ("flatnce", "split"),
    "siglip": ("siglip", "learnable"),
}


def make_step(variant: str, model_name: str):
    from vlp.config import LossConfig, ModelConfig
    from vlp.losses.registry import get_loss
    from vlp.train.optim import param_groups

    loss_name, temperature = VARIANTS[variant]
    torch.manual_seed(0)
    from vlp.models.model import build_model
    from vlp.losses.temperature import temperature_policy

    loss_cfg = LossConfig(name=loss_name, temperature=temperature)
    model, *_ = build_model(ModelConfig(name=model_name), loss_cfg)
    opt = torch.optim.AdamW(param_groups(model, 0.1), lr=1e-4, fused=True)
    loss_fn = get_loss(loss_name)
    scale_grad = temperature_policy(loss_cfg).scale_grad

    def step(images, text):
        out = model(images, text)
        loss, _ = loss_fn(out.image_emb, out.text_emb, out.image_emb, out.text_emb, out.logit_scale,
                          out.logit_bias, offset=0, scale_grad=scale_grad)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    return step


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--model", default="vlp-micro")
    ap.add_argument("--batch", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=3, help="timed steps per variant per round")
    ap.add_argument("--rounds", type=int, default=11)
    ap.add_argument("--clock", choices=("thread", "wall"), default="thread")
    args = ap.parse_args()
    clock = time.thread_time if args.clock == "thread" else time.perf_counter
    if args.quick:
        args.batch, args.steps, args.rounds = 32, 1, 2
    from vlp.models.model import model_config_dict

    cfg = model_config_dict(args.model)
    size, ctx = cfg["vision_cfg"]["image_size"], cfg["text_cfg"]["context_length"]
    g = torch.Generator().manual_seed(0)
    images = torch.randn(args.batch, 3, size, size, generator=g)
    text = torch.randint(1, 49000, (args.batch, ctx), generator=g)
    steps = {v: make_step(v, args.model) for v in VARIANTS}
    for v in VARIANTS:  # warm-up
        steps[v](images, text)
    names = list(VARIANTS)
    times: dict[str, list[float]] = {v: [] for v in names}
    for r in range(args.rounds):
        for v in names[r % len(names):] + names[:r % len(names)]:
            fastest = float("inf")
            for _ in range(args.steps):
                t0 = clock()
                steps[v](images, text)
                fastest = min(fastest, clock() - t0)
            times[v].append(fastest)
    print(f"## {args.model}, global batch {args.batch}, {args.rounds} rounds x min of {args.steps} steps, "
          f"threads {torch.get_num_threads()}, {args.clock} clock")
    for v in names:
        print(f"FIGURE step_time {v} = {1000 * median(times[v]):.1f} ms")
    for v in names[1:]:
        ratios = [a / b for a, b in zip(times[v], times["infonce"])]
        print(f"FIGURE step_time_ratio {v}/infonce = {median(ratios):.3f} x  [{min(ratios):.3f}..{max(ratios):.3f}]")


if __name__ == "__main__":
    main()
