"""One-GPU benchmark: vlp's train step vs open_clip_train's, ViT-B-32, bf16, batch 256.

    bash bench/gpu.sh                                    # on the GPU box (installs carried wheels)
    OMP_NUM_THREADS=1 python bench/gpu_bench.py --cpu --tiny   # CPU smoke run: vlp-micro, batch 8, 3 steps

Sections (each prints FIGURE lines; everything also goes to --out/gpu_bench.json):

1. synthetic: random image/text tensors already on the device (no data loading), timed over
   --steps steps after --warmup, alternating vlp / open_clip_train for --rounds rounds:
     vlp        vlp.train.loop.Trainer.train_step (Accelerate, autocast bf16, gathered InfoNCE +
                diagnostics, clamp, scheduler)
     open_clip  open_clip_train.train.train_one_epoch over the same batches (its autocast, ClipLoss,
                AdamW step, clamp), a fresh model with the same config and the same AdamW groups
   Figures: samples/s, ms/step, peak memory (torch.cuda.max_memory_allocated), MFU =
   FLOPs per step (torch.utils.flop_counter.FlopCounterMode over one vlp train step: model
   forward + backward + loss matmuls) / step time / peak (H200 bf16 dense 989 TFLOP/s).
2. real: synthetic 512 px JPEG shards written on the box (--real-samples, parallel), decoded
   by --workers loader workers per system:
     vlp             TrainData.groups() (vlp.data.stream, split mode) -> train_step; data.decode=cpu:
                     workers decode (crop-first, DCT scale from the crop box) and ship uint8
                     regions + boxes; the device resizes and normalises (vlp/data/device.py)
     vlp_gpu_decode  the same with data.decode=gpu: workers ship JPEG bytes + boxes, one batched
                     nvjpeg decode per micro-batch on the device (CUDA only; n/a on CPU)
     open_clip       open_clip_train.data.get_wds_dataset (persistent workers) -> train_one_epoch
   Timed from the start of step --warmup to the end of the last step.
3. host syncs per train step (synthetic uint8 batch, --steps steps, not logging steps): Python
   reads of tensor values (Tensor.item/tolist/cpu/numpy/__bool__/__float__/__int__) counted by a
   patch, and on CUDA the syncs torch.cuda.set_sync_debug_mode("warn") reports.

No timing assertions. On CPU (--cpu) memory and MFU print as n/a.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import tempfile
import time
from argparse import Namespace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench._common import REPO, bench_device, figure, header, jpeg_shards, median, scratch  # noqa: E402

H200_BF16_DENSE_FLOPS = 989e12


# ----------------------------------------------------------------------------- helpers
def sync(device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def reset_peak(device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def peak_gib(device) -> float:
    import torch

    return torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else float("nan")


def synthetic_batch(model_name: str, batch: int, device):
    import open_clip
    import torch

    cfg = open_clip.get_model_config(model_name)
    size = cfg["vision_cfg"]["image_size"]
    ctx = cfg["text_cfg"].get("context_length", 77)
    vocab = cfg["text_cfg"].get("vocab_size", 49408)
    g = torch.Generator().manual_seed(0)
    image = torch.randn(batch, 3, size, size, generator=g).to(device)
    text = torch.randint(1, vocab, (batch, ctx), generator=g).to(device)
    return {"image": image, "text": text}


# ----------------------------------------------------------------------------- vlp side
def build_vlp_trainer(args, spec: str, out_dir: str):
    from vlp.experiment import load_config
    from vlp.train.loop import Trainer

    cfg = load_config(None, [
        f"model.name={args.model}", f"data.train_shards={spec}", f"data.batch_per_device={args.batch}",
        f"data.num_workers={args.workers}", "data.shuffle_buffer=1000", f"train.precision={args.precision}",
        "train.samples=100000000", "train.log_every=1000000", f"train.output_dir={out_dir}",
        "optim.lr=5e-4", "optim.weight_decay=0.2", "optim.warmup_steps=2",
    ])
    return Trainer(cfg)


def vlp_synthetic(trainer, batch: dict, steps: int, warmup: int) -> float:
    import torch

    from vlp.data.train_data import Batch

    device = trainer.accelerator.device
    batch = Batch(batch["image"], batch["text"], torch.arange(len(batch["image"])))
    for _ in range(warmup):
        trainer.train_step([batch])
    sync(device)
    reset_peak(device)
    t0 = time.perf_counter()
    for _ in range(steps):
        trainer.train_step([batch])
    sync(device)
    return (time.perf_counter() - t0) / steps


def vlp_real(trainer, steps: int, warmup: int, decode: str = "cpu") -> float:
    device = trainer.accelerator.device
    trainer.cfg.data.decode = decode
    trainer.data = type(trainer.data)(trainer.cfg, trainer.train_transform, trainer.tokenizer, 0, 1, device=device)
    data = trainer.data.groups(trainer.accum)
    for _ in range(warmup):
        trainer.train_step(next(data))
    sync(device)
    reset_peak(device)
    t0 = time.perf_counter()
    for _ in range(steps):
        trainer.train_step(next(data))
    sync(device)
    dt = (time.perf_counter() - t0) / steps
    data.close()  # ends the loader and its workers
    return dt


READS = ("item", "tolist", "cpu", "numpy", "__bool__", "__float__", "__int__")


def host_syncs(trainer, batch: dict, steps: int) -> tuple[float, float]:
    """(Python reads of tensor values per train_step, CUDA syncs per step reported by
    set_sync_debug_mode; nan on CPU). The token ids' trim reads a host tensor: not counted."""
    import warnings

    import torch

    from vlp.data.train_data import Batch

    images = (batch["image"].clamp(-2, 2) * 50 + 128).to(torch.uint8).permute(0, 2, 3, 1).contiguous()
    micro = Batch(images, batch["text"].cpu(), torch.arange(len(images)))
    counts = {"n": 0, "host": 0}
    originals = {name: getattr(torch.Tensor, name) for name in READS}

    def counting(original):
        def read(self, *args, **kwargs):
            counts["n"] += counts["host"] == 0
            return original(self, *args, **kwargs)
        return read

    trim = trainer.unwrapped.trim_text

    def host_side(text):
        counts["host"] += 1
        try:
            return trim(text)
        finally:
            counts["host"] -= 1

    trainer.unwrapped.trim_text = host_side
    cuda = trainer.accelerator.device.type == "cuda"
    try:
        for name in READS:
            setattr(torch.Tensor, name, counting(originals[name]))
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            if cuda:
                torch.cuda.set_sync_debug_mode("warn")
            for _ in range(steps):
                trainer.train_step([micro])
    finally:
        if cuda:
            torch.cuda.set_sync_debug_mode(0)
        for name, original in originals.items():
            setattr(torch.Tensor, name, original)
        trainer.unwrapped.trim_text = trim
    synced = sum("synchroniz" in str(w.message) for w in caught)
    return counts["n"] / steps, synced / steps if cuda else float("nan")


def count_flops(trainer, batch: dict) -> int:
    from torch.utils.flop_counter import FlopCounterMode

    import torch

    from vlp.data.train_data import Batch

    batch = Batch(batch["image"], batch["text"], torch.arange(len(batch["image"])))
    with FlopCounterMode(display=False) as counter:
        trainer.train_step([batch])
    return int(counter.get_total_flops())


# ----------------------------------------------------------------------------- open_clip_train side
class _Batches:
    """An iterable with the attributes train_one_epoch reads (num_batches, num_samples);
    marks the time when batch `mark` is requested (after a device sync)."""

    def __init__(self, source, n: int, batch: int, mark: int, device):
        self.source, self.num_batches, self.num_samples = source, n, n * batch
        self.mark, self.device, self.t_mark = mark, device, None

    def __iter__(self):
        it = iter(self.source)
        for i in range(self.num_batches):
            if i == self.mark:
                sync(self.device)
                reset_peak(self.device)
                self.t_mark = time.perf_counter()
            yield next(it)


def open_clip_setup(args, device):
    import open_clip
    import torch
    from open_clip_train.train import train_one_epoch  # noqa: F401  (fail early if missing)

    import vlp.models.model  # noqa: F401  registers vlp/models/model_configs (vlp-micro, vlp-tiny)

    precision = {"bf16": "amp_bf16", "fp32": "fp32", "fp16": "amp"}[args.precision]
    model, preprocess_train, _ = open_clip.create_model_and_transforms(
        args.model, precision=precision, device=device, output_dict=True)
    from vlp.train.optim import param_groups

    optimizer = torch.optim.AdamW(param_groups(model, 0.2), lr=5e-4, betas=(0.9, 0.98), eps=1e-6)
    oc_args = Namespace(
        device=str(device), precision=precision, accum_freq=1, distill=False, skip_scheduler=True,
        grad_clip_norm=None, horovod=False, log_every_n_steps=10**9, batch_size=args.batch, world_size=1,
        rank=0, local_rank=0, wandb=False, model=args.model, siglip=False, local_loss=False,
        gather_with_grad=False, save_logs=False,
    )
    loss = open_clip.create_loss(oc_args)
    return model, optimizer, loss, oc_args, preprocess_train


def open_clip_epoch(setup, source, n: int, warmup: int, device) -> float:
    from open_clip_train.data import DataInfo
    from open_clip_train.train import train_one_epoch

    model, optimizer, loss, oc_args, _ = setup
    batches = _Batches(source, n + warmup, oc_args.batch_size, warmup, device)
    train_one_epoch(model, {"train": DataInfo(dataloader=batches)}, loss, 0, optimizer, None,
                    lambda step: None, None, oc_args, tb_writer=None)
    sync(device)
    return (time.perf_counter() - batches.t_mark) / n


def open_clip_synthetic(setup, batch: dict, steps: int, warmup: int, device) -> float:
    pair = (batch["image"], batch["text"])
    return open_clip_epoch(setup, iter(lambda: pair, None), steps, warmup, device)


def open_clip_real(setup, spec: str, args, device, steps: int, warmup: int) -> float:
    import open_clip
    from open_clip_train.data import get_wds_dataset

    _, _, _, oc_args, preprocess_train = setup
    data_args = Namespace(train_data=spec, val_data=None, dataset_resampled=False,
                          train_num_samples=(steps + warmup + 1) * args.batch,
                          train_data_upsampling_factors=None, seed=0, batch_size=args.batch, world_size=1,
                          workers=args.workers)
    info = get_wds_dataset(data_args, preprocess_train, is_train=True, epoch=0,
                           tokenizer=open_clip.get_tokenizer(args.model))
    dt = open_clip_epoch(setup, info.dataloader, steps, warmup, device)
    del info
    return dt


# ----------------------------------------------------------------------------- main
def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cpu", action="store_true", help="run on CPU (smoke test)")
    ap.add_argument("--tiny", action="store_true", help="vlp-micro, batch 8, 3 steps, 48 JPEGs, 1 worker")
    ap.add_argument("--model", default="ViT-B-32")
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--precision", default="bf16", choices=("bf16", "fp32"))
    ap.add_argument("--steps", type=int, default=50, help="timed steps (synthetic)")
    ap.add_argument("--warmup", type=int, default=10)
    ap.add_argument("--rounds", type=int, default=3, help="alternating synthetic rounds")
    ap.add_argument("--real-steps", type=int, default=30)
    ap.add_argument("--real-samples", type=int, default=12288, help="JPEGs written for the real-data runs")
    ap.add_argument("--workers", type=int, default=max(1, min(14, (os.cpu_count() or 2) - 2)))
    ap.add_argument("--peak-tflops", type=float, default=H200_BF16_DENSE_FLOPS / 1e12)
    ap.add_argument("--out", default=os.environ.get("OUT", str(REPO / "runs" / "gpu_bench")))
    ap.add_argument("--skip-real", action="store_true")
    args = ap.parse_args(argv)
    if args.tiny:
        args.model, args.batch, args.steps, args.warmup, args.rounds = "vlp-micro", 8, 3, 1, 1
        args.real_steps, args.real_samples, args.workers = 3, 48, 1
    import torch

    device, device_name = bench_device(args.cpu)
    header(f"GPU bench: {args.model}, {args.precision}, batch {args.batch}, device {device_name}, torch {torch.__version__}")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    results: dict = {"args": vars(args), "device": str(device)}

    t0 = time.time()
    per_shard = max(8, args.real_samples // max(16, args.workers))
    spec = jpeg_shards(out / "shards", args.real_samples, per_shard, size=512, workers=os.cpu_count() or 1)
    print(f"# {args.real_samples} JPEG pairs in {spec} ({time.time() - t0:.0f} s)", flush=True)

    tmp = scratch("gpu_bench_")
    trainer = build_vlp_trainer(args, spec, tmp)
    batch = synthetic_batch(args.model, args.batch, device)
    oc = open_clip_setup(args, device)

    # 1. synthetic, alternating
    step_s = {"vlp": [], "open_clip": []}
    mem = {}
    for r in range(args.rounds):
        order = ("vlp", "open_clip") if r % 2 == 0 else ("open_clip", "vlp")
        for system in order:
            if system == "vlp":
                dt = vlp_synthetic(trainer, batch, args.steps, args.warmup)
            else:
                dt = open_clip_synthetic(oc, batch, args.steps, args.warmup, device)
            step_s[system].append(dt)
            mem[system] = peak_gib(device)
            print(f"  round {r} {system:10s} {1e3 * dt:8.2f} ms/step  {args.batch / dt:9.1f} samples/s  "
                  f"peak {mem[system]:.2f} GiB", flush=True)
    flops = count_flops(trainer, batch)
    results["flops_per_step"] = flops
    print(f"# FLOPs per train step (FlopCounterMode, fwd+bwd): {flops / 1e9:.4g} GFLOP "
          f"({flops / args.batch / 1e9:.4g} GFLOP/sample)")
    figure("gpu_flops_per_step", flops / 1e9, "GFLOP")
    for system, xs in step_s.items():
        dt = median(xs)
        mfu = flops / dt / (args.peak_tflops * 1e12) if device.type == "cuda" else float("nan")
        results[f"synthetic/{system}"] = {"step_s": xs, "samples_per_s": args.batch / dt,
                                          "peak_mem_gib": mem[system], "mfu": mfu}
        figure(f"gpu_synthetic_samples_per_s {system}", args.batch / dt, "samples/s",
               f"{1e3 * dt:.2f} ms/step")
        figure(f"gpu_synthetic_peak_mem {system}", mem[system], "GiB")
        figure(f"gpu_synthetic_mfu {system}", mfu, "", f"of {args.peak_tflops:.0f} TFLOP/s bf16 dense"
               if device.type == "cuda" else "n/a on CPU")
    ratio = median([o / v for v, o in zip(step_s["vlp"], step_s["open_clip"])])
    figure("gpu_synthetic_ratio vlp/open_clip", ratio, "x", "samples/s, per round, median")

    # 2. real JPEG shards
    if not args.skip_real:
        real = {}
        for system in ("vlp", "vlp_gpu_decode", "open_clip"):
            if system == "open_clip":
                dt = open_clip_real(oc, spec, args, device, args.real_steps, args.warmup)
            elif system == "vlp_gpu_decode" and device.type != "cuda":
                print("  vlp_gpu_decode: n/a without CUDA (data.decode=gpu is refused)", flush=True)
                dt = float("nan")
            else:
                dt = vlp_real(trainer, args.real_steps, args.warmup, "gpu" if system == "vlp_gpu_decode" else "cpu")
                if system == "vlp_gpu_decode" and trainer.data.device_images is not None:
                    counts = {**trainer.data.device_images.counts, **trainer.data.device_images.jpeg.counts}
                    results["gpu_decode_counts"] = counts
                    print(f"  vlp_gpu_decode routes: {counts}", flush=True)
            real[system] = dt
            results[f"real/{system}"] = {"step_s": dt, "samples_per_s": args.batch / dt,
                                         "peak_mem_gib": peak_gib(device)}
            figure(f"gpu_real_samples_per_s {system}", args.batch / dt, "samples/s",
                   f"{1e3 * dt:.2f} ms/step, {args.workers} workers")
        figure("gpu_real_ratio vlp/open_clip", real["open_clip"] / real["vlp"], "x")
        figure("gpu_real_ratio vlp_gpu_decode/open_clip", real["open_clip"] / real["vlp_gpu_decode"], "x")
        figure("gpu_real_ratio vlp_gpu_decode/vlp", real["vlp"] / real["vlp_gpu_decode"], "x")

    # 3. host syncs per step
    reads, synced = host_syncs(trainer, batch, max(args.steps, 3))
    results["host_syncs_per_step"] = {"tensor_reads": reads, "cuda_sync_warnings": synced}
    figure("gpu_host_syncs_per_step vlp", reads, "reads", "Python reads of tensor values, non-logging steps")
    figure("gpu_cuda_syncs_per_step vlp", synced, "syncs", "set_sync_debug_mode" if device.type == "cuda" else "n/a on CPU")
    (out / "gpu_bench.json").write_text(json.dumps(results, indent=2, default=str))
    print(f"# results in {out / 'gpu_bench.json'}")
    if math.isnan(ratio):
        raise SystemExit("no ratio")


if __name__ == "__main__":
    main()
