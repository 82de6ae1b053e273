"""FSDP vs DDP on 2 CPU processes (gloo): step time and per-rank parameter + AdamW-state bytes.

Both variants live in the same 2 ranks and alternate round by round (rotated order), so machine
load hits them alike; the step-time ratio is taken per round and its median reported. One step is
what `Trainer.train_step` does: encoders forward, differentiable gather, InfoNCE over the global
batch, backward (DDP all-reduce / FSDP2 reduce-scatter), the replicated logit_scale's gradient
average (FSDP), fused AdamW, the temperature clamp. Bytes are what each rank holds after a step:
parameters and optimizer state, local shards under FSDP (goal: about 1/world of DDP's).

    OMP_NUM_THREADS=1 .venv/bin/python bench/fsdp_cost.py              # ~1 min
    OMP_NUM_THREADS=1 .venv/bin/python bench/fsdp_cost.py --quick      # smoke test
"""

from __future__ import annotations

import argparse
import datetime
import gc
import os
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench._common import figure, header, median, paired_ratio, rank_bytes, spread  # noqa: E402

WORLD = 2


def make_variant(mode: str, model_name: str, batch: int):
    """(step function, model, optimizer) for `mode` on this rank; same init on every rank."""
    from torch.nn.parallel import DistributedDataParallel

    from vlp.train import parallel
    from vlp.config import LossConfig, ModelConfig
    from vlp.distributed import gather_with_grad, positive_offset
    from vlp.losses.registry import get_loss
    from vlp.models.model import build_model
    from vlp.train.optim import param_groups

    torch.manual_seed(0)
    model = build_model(ModelConfig(name=model_name), LossConfig(name="infonce", temperature="learnable"))[0]
    inner = model
    if mode == "fsdp":
        model = inner = parallel.apply_fsdp(model, "cpu")
    else:
        model = DistributedDataParallel(model)
    opt = torch.optim.AdamW(param_groups(inner, 0.1), lr=1e-4, fused=True)
    loss_fn = get_loss("infonce")
    rank = torch.distributed.get_rank()
    gen = torch.Generator().manual_seed(rank)
    size = inner.clip.visual.image_size[0]
    images = torch.randn(batch, 3, size, size, generator=gen)
    texts = torch.randint(1, 49000, (batch, inner.clip.context_length), generator=gen)

    def step() -> None:
        out = model(images, texts)
        img, txt = gather_with_grad(out.image_emb), gather_with_grad(out.text_emb)
        loss, _ = loss_fn(out.image_emb, out.text_emb, img, txt, out.logit_scale, out.logit_bias,
                          offset=positive_offset(batch, img.shape[0]))
        loss.backward()
        if mode == "fsdp":
            parallel.sync_replicated_grads(model)
        opt.step()
        opt.zero_grad(set_to_none=True)
        with torch.no_grad():
            inner.log_logit_scale.clamp_(0, 4.6052)

    return step, inner, opt


def timed(step, steps: int) -> float:
    """Median wall seconds per step over `steps` steps, each started together on all ranks."""
    times = []
    for _ in range(steps):
        torch.distributed.barrier()
        t = time.perf_counter()
        step()
        torch.distributed.barrier()
        times.append(time.perf_counter() - t)
    return median(times)


def worker(rank: int, args, tmp: str) -> None:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)
    torch.distributed.init_process_group("gloo", init_method=f"file://{tmp}/rendezvous", rank=rank,
                                         world_size=WORLD, timeout=datetime.timedelta(seconds=300))
    from vlp.train import parallel

    variants = {mode: make_variant(mode, args.model, args.batch) for mode in ("ddp", "fsdp")}
    for step, _, _ in variants.values():  # warm up; creates the AdamW state
        step()
    per_step = {mode: [] for mode in variants}
    for r in range(args.rounds):
        order = list(variants)[r % 2:] + list(variants)[:r % 2]
        for mode in order:
            per_step[mode].append(timed(variants[mode][0], args.steps))
    nbytes = {mode: rank_bytes(model, opt) for mode, (_, model, opt) in variants.items()}
    gathered = [None] * WORLD
    torch.distributed.all_gather_object(gathered, nbytes)
    if rank == 0:
        report(args, per_step, gathered)
    # drop the models (DDP's reducer holds the group), collect, meet, then destroy: otherwise gloo
    # can abort the process at interpreter exit
    del variants
    gc.collect()
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


def report(args, per_step: dict, nbytes: list[dict]) -> None:
    mib = 2 ** 20
    print(f"# model {args.model}, {args.batch} pairs per rank x {WORLD} ranks, {args.steps} steps x "
          f"{args.rounds} rounds (median per round)")
    print(f"{'':28s}{'ddp':>14s}{'fsdp':>14s}{'fsdp/ddp':>10s}")
    step_ratio = paired_ratio(per_step["fsdp"], per_step["ddp"])
    rows = [("step time (ms)", 1e3 * median(per_step["ddp"]), 1e3 * median(per_step["fsdp"]), median(step_ratio))]
    for r in range(WORLD):
        (dp, do), (fp, fo) = nbytes[r]["ddp"], nbytes[r]["fsdp"]
        rows.append((f"rank {r} params (MiB)", dp / mib, fp / mib, fp / dp))
        rows.append((f"rank {r} AdamW state (MiB)", do / mib, fo / mib, fo / do))
        rows.append((f"rank {r} params+state (MiB)", (dp + do) / mib, (fp + fo) / mib, (fp + fo) / (dp + do)))
    for name, a, b, ratio in rows:
        print(f"{name:28s}{a:14.3f}{b:14.3f}{ratio:10.3f}")
    worst = max((nbytes[r]["fsdp"][0] + nbytes[r]["fsdp"][1]) / sum(nbytes[r]["ddp"]) for r in range(WORLD))
    figure("fsdp_step_time_ratio fsdp/ddp", median(step_ratio), "", spread(step_ratio))
    figure("fsdp_bytes_per_rank_ratio fsdp/ddp", worst, "", f"params + AdamW state, worst rank; goal {1 / WORLD:.2f}")
    figure("fsdp_step_ms ddp", 1e3 * median(per_step["ddp"]), "ms")
    figure("fsdp_step_ms fsdp", 1e3 * median(per_step["fsdp"]), "ms")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="vlp-tiny")
    parser.add_argument("--batch", type=int, default=32, help="pairs per rank")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--quick", action="store_true", help="vlp-micro, 2 steps, 1 round (smoke test)")
    args = parser.parse_args()
    if args.quick:
        args.model, args.batch, args.steps, args.rounds = "vlp-micro", 8, 2, 2
    header("FSDP vs DDP, 2 CPU processes (gloo)")
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory(prefix="vlp_fsdp_cost_") as tmp:
        mp.spawn(worker, args=(args, tmp), nprocs=WORLD, join=True)


if __name__ == "__main__":
    main()
