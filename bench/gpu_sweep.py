"""Per-GPU batch sweep (issue 42): is a vlp step bound by the device or by Python?

    python bench/gpu_sweep.py                     # on the GPU box (bench/gpu.sh runs it)
    OMP_NUM_THREADS=1 python bench/gpu_sweep.py --cpu --tiny   # CPU smoke run (tests/test_bench_smoke.py)

At each per-GPU batch (--batches, default 8,32,128,256), side by side in one process, on the same
synthetic device tensors (bf16 autocast, ViT-B-32; no data loading):

    vlp_eager          Trainer.train_step (today's step: one host read a step)
    vlp_graphs         the same trainer with train.cuda_graphs's StaticStep (vlp/train/static_step.py):
                       WARMUP_STEPS eager steps, one capture, then replays (on CPU: eager, no capture)
    vlp_compile        train.compile=true (the towers through torch.compile), eager step   } --compile-batches,
    vlp_compile_graphs the compiled towers inside the captured step                       } after the CLI runs
    open_clip          open_clip_train.train.train_one_epoch (bench/gpu_bench.py's setup)
    bare               an independent loop: the same open_clip model, fused AdamW, open_clip's
                       ClipLoss, autocast, tensors already on the device, nothing else

First, parity (`graph_parity`): vlp-micro in fp32, 20 steps eager vs the static step (captured
and replayed on CUDA), infonce and sogclr, a NaN image at step 15: the largest weight
difference, whether the NaN step left the weights bit-equal, the skipped-step counts.

Figures per (system, batch): ms/step, samples/s, MFU (FLOPs of one vlp step by FlopCounterMode /
step time / --peak-tflops) and peak memory (torch.cuda.max_memory_allocated over the timed steps).
With --cli-steps N it then runs `vlp train -c configs/gpu_vitb32.yaml` N steps on gpu_bench.py's
JPEG shards, eager and with train.cuda_graphs=true, and reports the samples/s its log.jsonl shows.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench._common import REPO, bench_device, figure, header, jpeg_shards, scratch  # noqa: E402
from bench.gpu_bench import (H200_BF16_DENSE_FLOPS, count_flops, host_syncs, open_clip_setup,  # noqa: E402
                             open_clip_synthetic, peak_gib, reset_peak, sync, synthetic_batch)


def vlp_trainer(args, spec: str, batch: int, compile_towers: bool):
    from vlp.experiment import load_config
    from vlp.train.loop import Trainer

    cfg = load_config(None, [
        f"model.name={args.model}", f"data.train_shards={spec}", f"data.batch_per_device={batch}",
        "data.num_workers=0", f"train.precision={args.precision}", "train.samples=100000000",
        "train.log_every=1000000", f"train.output_dir={scratch('gpu_sweep_')}",
        "optim.lr=5e-4", "optim.weight_decay=0.2", "optim.warmup_steps=2", "optim.grad_clip=1.0",
        f"train.compile={str(compile_towers).lower()}",
        f"train.cuda_graphs={str(torch_cuda()).lower()}"])  # as the CLI builds it (refused on CPU)
    return Trainer(cfg)


def torch_cuda() -> bool:
    import torch

    return torch.cuda.is_available() and os.environ.get("ACCELERATE_USE_CPU") != "true"


def timed(step, steps: int, warmup: int, device) -> tuple[float, float]:
    """(seconds per step over `steps` after `warmup`, peak GiB over the timed steps)."""
    for _ in range(warmup):
        step()
    sync(device)
    reset_peak(device)
    t0 = time.perf_counter()
    for _ in range(steps):
        step()
    sync(device)
    return (time.perf_counter() - t0) / steps, peak_gib(device)


def vlp_runs(args, spec, batch: dict, b: int, device, compile_towers: bool) -> dict:
    """{system: (s/step, peak GiB)} of one trainer, eager then with the static step."""
    from vlp.data.train_data import Batch
    from vlp.train.static_step import WARMUP_STEPS, StaticStep

    trainer = vlp_trainer(args, spec, b, compile_towers)
    static = trainer.static_step or StaticStep(trainer, capture=False)  # the CLI's (CUDA) or an eager one (CPU)
    trainer.static_step = None  # first the eager step
    group = [Batch(batch["image"], batch["text"].cpu(), torch_arange(b))]  # tokens trimmed on the host
    eager, graphs = ("vlp_compile", "vlp_compile_graphs") if compile_towers else ("vlp_eager", "vlp_graphs")
    out = {eager: timed(lambda: trainer.train_step(group), args.steps, args.warmup, device)}
    if b not in args.flops:  # FLOPs of one eager step (a replayed graph runs no Python to count)
        out["flops"] = count_flops(trainer, batch)
    trainer.static_step = static
    out[graphs] = timed(lambda: trainer.train_step(group), args.steps, WARMUP_STEPS + 2, device)
    if b == args.batches[0] and not compile_towers:  # no sync step among them (log_every is huge)
        reads, syncs = host_syncs(trainer, batch, 5)
        figure(f"gpu_sweep_host_syncs_per_step vlp_graphs b={b}", reads, "reads",
               f"Python reads of tensor values; CUDA syncs (set_sync_debug_mode) {syncs:g}")
    return out


def torch_arange(n: int):
    import torch

    return torch.arange(n)


def bare_loop(args, batch: dict, device):
    """One step of the bare loop (module docstring), as a closure."""
    import open_clip
    import torch

    from vlp.train.optim import param_groups

    model = open_clip.create_model(args.model, device=device, output_dict=True)
    opt = torch.optim.AdamW(param_groups(model, 0.2), lr=5e-4, betas=(0.9, 0.98), eps=1e-6, fused=True)
    loss_fn = open_clip.ClipLoss()
    image, text = batch["image"], batch["text"]

    def step():
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=args.precision == "bf16"):
            out = model(image, text)
            loss = loss_fn(out["image_features"], out["text_features"], out["logit_scale"])
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return step


def graph_parity(args, spec: str, device, loss: str, steps: int = 20, bad: int = 15) -> dict:
    """Replays equal eager steps: two vlp-micro fp32 trainers from the same weights over the same
    batches, one eager, one with the static step (captured on CUDA after WARMUP_STEPS); step
    `bad` gets a NaN image (under replay no Python runs: the skip must happen in the graph)."""
    import torch

    from vlp.experiment import load_config
    from vlp.train.loop import Trainer
    from vlp.train.static_step import StaticStep

    def trainer():
        return Trainer(load_config(None, [
            "model.name=vlp-micro", f"data.train_shards={spec}", "data.batch_per_device=8", "data.num_workers=0",
            f"loss.name={loss}", "train.samples=100000", "optim.grad_clip=1.0", "optim.warmup_steps=3",
            f"train.output_dir={scratch('gpu_parity_')}", "train.log_every=5"]))

    eager, static = trainer(), trainer()
    static.unwrapped.load_state_dict(eager.unwrapped.state_dict())
    static.static_step = StaticStep(static, capture=device.type == "cuda")
    groups = eager.data.groups(1)
    batches = [next(groups) for _ in range(steps)]
    groups.close()
    worst, untouched = 0.0, None
    for i, group in enumerate(batches):
        if i == bad:
            group = nan_image(eager, group)
            before = [p.detach().clone() for p in static.unwrapped.parameters()]
        eager.train_step(group), static.train_step(group)
        if i == bad:
            untouched = all(torch.equal(a, p) for a, p in zip(before, static.unwrapped.parameters()))
        worst = max(worst, max((a - b).abs().max().item() for a, b in zip(eager.unwrapped.parameters(),
                                                                            static.unwrapped.parameters())))
    figure(f"gpu_graphs_max_abs_diff {loss}", worst, "", f"{steps} steps, eager vs "
           f"{'captured' if static.static_step.graphs else 'static (not captured)'}, fp32")
    figure(f"gpu_graphs_nan_step_untouched {loss}", float(untouched), "", "1: weights bit-equal across the NaN step")
    figure(f"gpu_graphs_skipped {loss}", static.nonfinite_total, "steps", f"eager skipped {eager.nonfinite_total}")
    return {"max_abs_diff": worst, "nan_step_untouched": untouched, "captured": bool(static.static_step.graphs),
            "skipped": [eager.nonfinite_total, static.nonfinite_total]}


def nan_image(trainer, group: list) -> list:
    """`group` with its images through the device transform (a float batch on the device, which
    the step passes through) and every pixel of the first image NaN."""
    from dataclasses import replace

    batch = trainer.data.feed(group)[0]
    image = trainer.data.device_images(batch.image).clone()
    image[0] = float("nan")
    return [replace(batch, image=image)]


def sweep(args, spec: str, device, compiled: bool = False) -> dict:
    """{batch: {system: figures}}; each printed as soon as measured (a run cut by gpu.sh's
    timeout keeps what it printed). compiled: only the train.compile runs of --compile-batches."""
    import vlp.models.model  # noqa: F401  registers vlp/models/model_configs (vlp-micro) with open_clip

    results: dict = {}
    for b in args.compile_batches if compiled else args.batches:
        batch = synthetic_batch(args.model, b, device)
        runs = vlp_runs(args, spec, batch, b, device, compile_towers=compiled)
        if not compiled:
            runs["open_clip"] = timed_open_clip(args, batch, b, device)
            runs["bare"] = timed(bare_loop(args, batch, device), args.steps, args.warmup, device)
        flops = args.flops[b] = runs.pop("flops", None) or args.flops.get(b)
        figure(f"gpu_sweep_flops_per_step b={b}", flops / 1e9, "GFLOP")
        for system, (dt, mem) in runs.items():
            mfu = flops / dt / (args.peak_tflops * 1e12) if device.type == "cuda" else float("nan")
            figure(f"gpu_sweep_samples_per_s {system} b={b}", b / dt, "samples/s",
                   f"{1e3 * dt:.2f} ms/step, MFU {100 * mfu:.1f} %, peak {mem:.2f} GiB")
            runs[system] = {"step_s": dt, "samples_per_s": b / dt, "mfu": mfu, "peak_mem_gib": mem}
        results[b] = runs
    return results


def timed_open_clip(args, batch: dict, b: int, device) -> tuple[float, float]:
    import argparse as _argparse

    setup = open_clip_setup(_argparse.Namespace(**{**vars(args), "batch": b}), device)
    dt = open_clip_synthetic(setup, batch, args.steps, args.warmup, device)
    return dt, peak_gib(device)


def cli_runs(args, spec: str, out: Path) -> dict:
    """`vlp train -c configs/gpu_vitb32.yaml` for --cli-steps steps (eager, graphs): the mean
    samples/s of its logged lines after the first."""
    results = {}
    batch = 256 if not args.tiny else 8
    for name, extra in (("cli_eager", []), ("cli_graphs", ["train.cuda_graphs=true"])):
        if name == "cli_graphs" and args.cpu:  # vlp refuses train.cuda_graphs off CUDA: no process for that line
            print(f"  {name}: skipped (CUDA graphs need a CUDA device; --cpu)", flush=True)
            continue
        run = out / name
        cmd = [sys.executable, "-m", "vlp", "train", "-c", str(REPO / "configs/gpu_vitb32.yaml"),
               f"data.train_shards={spec}", "data.eval_shards=null", f"train.output_dir={run}",
               "train.resume=null", f"train.samples={args.cli_steps * batch}", "train.eval_every=0",
               "train.checkpoint_every=0", "train.save_final=false", f"train.log_every={max(1, args.cli_steps // 3)}",
               *([f"data.num_workers={args.workers}", "model.name=vlp-micro", f"data.batch_per_device={batch}",
                  "train.precision=fp32"] if args.tiny else []), *extra]  # else the config's own workers
        t0 = time.time()
        proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True)
        if proc.returncode != 0:
            print(f"  {name}: exit {proc.returncode}: {proc.stderr.strip().splitlines()[-1:]}", flush=True)
            results[name] = {"error": proc.stderr[-2000:]}
            continue
        logged = [json.loads(x) for x in (run / "log.jsonl").read_text().splitlines()]
        sps = [r["samples_per_s"] for r in logged if r.get("type") == "train"][1:] or [float("nan")]
        results[name] = {"samples_per_s": sum(sps) / len(sps), "wall_s": time.time() - t0}
        figure(f"gpu_cli_samples_per_s {name}", results[name]["samples_per_s"], "samples/s",
               f"batch {batch}, {args.cli_steps} steps, {time.time() - t0:.0f} s wall")
    return results


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cpu", action="store_true")
    ap.add_argument("--tiny", action="store_true", help="vlp-micro, batches 4,8, 3 steps, fp32")
    ap.add_argument("--model", default="ViT-B-32")
    ap.add_argument("--batches", default="8,32,128,256")
    ap.add_argument("--compile-batches", default="32,256", help="batches also run with train.compile=true")
    ap.add_argument("--precision", default="bf16", choices=("bf16", "fp32"))
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--cli-steps", type=int, default=0, help="also run `vlp train` this many steps (0: no)")
    ap.add_argument("--real-samples", type=int, default=12288, help="gpu_bench.py's shards (the CLI runs)")
    ap.add_argument("--workers", type=int, default=max(1, min(14, (os.cpu_count() or 2) - 2)))
    ap.add_argument("--peak-tflops", type=float, default=H200_BF16_DENSE_FLOPS / 1e12)
    ap.add_argument("--out", default=os.environ.get("OUT", str(REPO / "runs" / "gpu_bench")))
    args = ap.parse_args(argv)
    if args.tiny:
        args.model, args.batches, args.compile_batches, args.steps, args.warmup = "vlp-micro", "4,8", "", 3, 1
        args.precision, args.real_samples, args.workers = "fp32", 48, 1
    args.batches = [int(x) for x in args.batches.split(",") if x]
    args.compile_batches = [int(x) for x in args.compile_batches.split(",") if x]
    import torch

    device, device_name = bench_device(args.cpu)
    header(f"GPU sweep: {args.model}, {args.precision}, batches {args.batches}, device {device_name}, torch {torch.__version__}")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    per_shard = max(8, args.real_samples // max(16, args.workers))  # gpu_bench.py's shards (cached)
    spec = jpeg_shards(out / "shards", args.real_samples, per_shard, size=512, workers=os.cpu_count() or 1)
    args.flops = {}  # batch -> FLOPs of one step
    results = {"args": vars(args), "device": str(device),
               "parity": {loss: graph_parity(args, spec, device, loss) for loss in ("infonce", "sogclr")},
               "sweep": sweep(args, spec, device)}
    (out / "gpu_sweep.json").write_text(json.dumps(results, indent=2, default=str))
    if args.cli_steps:
        results["cli"] = cli = cli_runs(args, spec, out)
        bench = results["sweep"].get(args.batches[-1], {}).get("vlp_eager", {}).get("samples_per_s")
        for name, run in cli.items():
            if bench and "samples_per_s" in run:
                figure(f"gpu_cli_ratio {name}/vlp_eager b={args.batches[-1]}", run["samples_per_s"] / bench, "x",
                       "real shards through the CLI vs synthetic device tensors")
    if args.compile_batches:  # last: torch.compile's first step takes about a minute per batch
        results["compiled"] = sweep(args, spec, device, compiled=True)
    (out / "gpu_sweep.json").write_text(json.dumps(results, indent=2, default=str))
    print(f"# results in {out / 'gpu_sweep.json'}")


if __name__ == "__main__":
    main()
