"""Step-time overhead of saving checkpoints to a bucket (RunFolder.publish, background upload)
vs a local folder, side by side in one run.

    OMP_NUM_THREADS=1 python bench/bucket_save.py           # vlp-micro state + a 200 MB dummy, 3 rounds
    OMP_NUM_THREADS=1 python bench/bucket_save.py --quick   # vlp-micro state + a 20 MB dummy, 1 round
    OMP_NUM_THREADS=1 python bench/bucket_save.py --trainer # `vlp train` itself: checkpoints to moto vs local

The bucket is moto's S3 server on 127.0.0.1 in its own process (s3fs through
AWS_ENDPOINT_URL), so its CPU is not this process's GIL; on this machine it still shares the
two cores with the loop, which a real bucket would not.

A "training loop" of ``--steps`` steps, each a fixed CPU workload of about ``--step-ms`` (a
matmul chain on one thread: the model's compute, no data loading), saves a checkpoint every
``--every`` steps through ``vlp.checkpoint.storage.RunFolder`` (stage, publish in the background, prune):

  none    no saves (the reference step time)
  local   RunFolder(<tmp dir>): torch.save into a stage file beside the target, renamed in the background
  bucket  RunFolder(s3://bench/run): torch.save into a local stage folder, then ``publish``
          uploads in a background thread (the object, then prune to 2) while
          the loop goes on;
          the next publish and the end wait for it

Checkpoint contents: vlp-micro's model + AdamW state after one step (the real state dict), and a
dummy of ``--dummy-mb`` MB (one float32 tensor: a ViT-B/32-sized save is 1.8 GB, DESIGN.md §6).
FIGUREs: wall time of the steps relative to ``none`` for local and bucket, the seconds the loop
was blocked per save (torch.save + what publish waited for) and the final wait for the last
upload (after the loop; in a run it overlaps the export and the last eval).

``--trainer``: the real trainer instead of the synthetic loop. ``vlp train`` (``--model``,
default vlp-micro, on 320 embedded OpenMoji pairs at 32 px, ``--steps`` steps of batch 16) three
ways per round, rotating which goes first: ``none`` (train.checkpoint_every=0), ``local``
(train.output_dir=<tmp dir>) and ``bucket`` (train.output_dir=s3://bench/...), both with a
checkpoint every ``--every`` steps and keep_last=2. The figure is result.json's train_time_s
(the steps, their saves and uploads in flight; not the start-up, the final save and export)
relative to ``none``, and bucket/local paired per round.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench._common import PYTHON, bench_env, figure, free_port, header, median, pin_threads  # noqa: E402

S3_ENV = {"AWS_ACCESS_KEY_ID": "bench", "AWS_SECRET_ACCESS_KEY": "bench", "AWS_DEFAULT_REGION": "us-east-1",
          "AWS_EC2_METADATA_DISABLED": "true"}


def start_moto() -> tuple[subprocess.Popen, str]:
    port = free_port()
    proc = subprocess.Popen([PYTHON, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
                            env=bench_env(**S3_ENV), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 30
    while True:
        try:
            urllib.request.urlopen(url + "/moto-api/", timeout=1).close()
            return proc, url
        except OSError:
            if proc.poll() is not None or time.monotonic() > deadline:
                proc.kill()
                raise RuntimeError("moto server did not start within 30 s")
            time.sleep(0.1)


def micro_state() -> dict:
    """vlp-micro's model and AdamW state after one optimizer step (what a checkpoint holds)."""
    import torch

    from vlp.experiment import load_config
    from vlp.models.model import build_model

    cfg = load_config(None, ["model.name=vlp-micro"])
    model = build_model(cfg.model, cfg.loss)[0]
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    sum(p.float().sum() for p in model.parameters()).backward()
    opt.step()
    return {"model": model.state_dict(), "optimizer": opt.state_dict(), "step": 1}


def make_step(step_ms: float):
    """A fixed CPU workload of about step_ms milliseconds."""
    import torch

    a = torch.randn(384, 384)
    t = time.perf_counter()
    for _ in range(20):
        a = torch.tanh(a @ a)
    per = (time.perf_counter() - t) / 20
    n = max(1, round(step_ms / 1000 / per))

    def step():
        x = a
        for _ in range(n):
            x = torch.tanh(x @ a)
        return x

    return step


def run_loop(step, steps: int, every: int, folder, state) -> tuple[float, list[float], float]:
    """(wall seconds of the steps, blocked seconds per save, seconds of the final wait for the
    last upload: in a real run that one overlaps the final export and eval)."""
    import torch

    from vlp.checkpoint.checkpointer import prune

    blocked = []
    t0 = time.perf_counter()
    for i in range(1, steps + 1):
        step()
        if folder is not None and i % every == 0:
            t = time.perf_counter()
            name = f"checkpoints/step_{i:08d}.pt"
            stage = folder.stage(name)
            torch.save(state, stage)
            folder.publish(stage, name, then=lambda: prune(folder.sub("checkpoints"), 2))
            blocked.append(time.perf_counter() - t)
    loop = time.perf_counter() - t0
    if folder is not None:
        folder.wait()
    return loop, blocked, time.perf_counter() - t0 - loop


def trainer_runs(args, endpoint: str) -> None:
    """``--trainer``: `vlp train` with checkpoints to the bucket vs a local folder (docstring)."""
    import json

    import fsspec

    from bench._common import paired_ratio, run, spread
    from vlp.data.sources.openmoji import load_pairs
    from vlp.data.write import write_shards

    steps, every, rounds = args.steps or 60, args.every or 10, args.rounds or 3
    tmp = Path(tempfile.mkdtemp(prefix="vlp-bench-trainer-"))
    shards = write_shards(load_pairs("train", image_size=32)[:320], tmp / "shards", prefix="train",
                          samples_per_shard=64).spec
    env = bench_env(**S3_ENV, AWS_ENDPOINT_URL=endpoint, GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT="false")
    fs = fsspec.filesystem("s3")
    header(f"vlp train ({args.model}, {steps} steps of batch 16, a checkpoint every {every}, {rounds} round(s)): "
           "checkpoints to moto S3 on 127.0.0.1 vs a local folder")

    def train(kind: str, r: int) -> float:
        out = f"s3://bench/trainer-{r}" if kind == "bucket" else str(tmp / f"{kind}-{r}")
        run([PYTHON, "-m", "vlp", "train", "-c", "configs/demo.yaml", f"model.name={args.model}",
             f"data.train_shards={shards}", "data.batch_per_device=16", f"train.samples={16 * steps}",
             "train.log_every=10", "data.shuffle_buffer=64", f"train.output_dir={out}", "train.keep_last=2",
             f"train.checkpoint_every={0 if kind == 'none' else every}"], env=env)
        text = fs.cat_file(out[5:] + "/result.json") if kind == "bucket" else Path(out, "result.json").read_text()
        return json.loads(text)["train_time_s"]

    times: dict[str, list[float]] = {"none": [], "local": [], "bucket": []}
    for r in range(rounds):
        kinds = ("none", "local", "bucket")
        for kind in kinds[r % 3:] + kinds[:r % 3]:
            times[kind].append(train(kind, r))
    for kind in ("none", "local", "bucket"):
        print(f"# train_time_s {kind}: {spread(times[kind])}")
    for kind in ("local", "bucket"):
        figure(f"trainer_step_time_ratio {args.model} {kind}/none", median(paired_ratio(times[kind], times["none"])),
               "x", f"({steps // every} checkpoints in {steps} steps)")
    figure(f"trainer_step_time_ratio {args.model} bucket/local", median(paired_ratio(times["bucket"], times["local"])),
           "x", spread(paired_ratio(times["bucket"], times["local"])))
    shutil.rmtree(tmp, ignore_errors=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--trainer", action="store_true", help="time `vlp train` itself (checkpoints to moto vs local)")
    ap.add_argument("--model", default="vlp-micro", help="--trainer: model.name")
    ap.add_argument("--steps", type=int, default=None)
    ap.add_argument("--every", type=int, default=None)
    ap.add_argument("--step-ms", type=float, default=100.0)
    ap.add_argument("--dummy-mb", type=int, default=None)
    ap.add_argument("--rounds", type=int, default=None)
    args = ap.parse_args()
    pin_threads()
    proc, endpoint = start_moto()
    os.environ.update(S3_ENV, AWS_ENDPOINT_URL=endpoint)
    try:
        import fsspec

        fsspec.filesystem("s3").mkdir("bench")
        (trainer_runs if args.trainer else synthetic_runs)(args, endpoint)
    finally:
        proc.kill()
        proc.wait()


def synthetic_runs(args, endpoint: str) -> None:
    """The synthetic loop's figures (module docstring)."""
    import torch

    from vlp.checkpoint.storage import RunFolder

    steps = args.steps or (30 if args.quick else 60)
    every = args.every or (10 if args.quick else 20)
    dummy_mb = args.dummy_mb or (20 if args.quick else 200)
    rounds = args.rounds or (1 if args.quick else 3)
    states = {"micro": micro_state(), f"dummy{dummy_mb}MB": {"x": torch.zeros(dummy_mb << 18)}}
    step = make_step(args.step_ms)
    header(f"checkpoint save overhead: {steps} steps of ~{args.step_ms:.0f} ms, a save every {every}, "
           f"{rounds} round(s); bucket = moto S3 on 127.0.0.1")
    for label, state in states.items():
        tmp = Path(tempfile.mkdtemp(prefix="vlp-bench-save-"))
        size_mb = sum(v.numel() * v.element_size() for v in _tensors(state)) / 1e6
        walls: dict[str, list[float]] = {"none": [], "local": [], "bucket": []}
        step()  # warm up
        blocks: dict[str, list[float]] = {"local": [], "bucket": []}
        tails: dict[str, list[float]] = {"local": [], "bucket": []}
        for r in range(rounds):
            kinds = ("none", "local", "bucket")
            for kind in kinds[r % 3:] + kinds[:r % 3]:  # rotate which goes first
                folder = None
                if kind == "local":
                    folder = RunFolder(tmp / f"run{r}")
                elif kind == "bucket":
                    folder = RunFolder(f"s3://bench/{label}-{r}", cache_dir=str(tmp / f"cache{r}"))
                wall, blocked, tail = run_loop(step, steps, every, folder, state)
                walls[kind].append(wall)
                if folder is not None:
                    blocks[kind].extend(blocked)
                    tails[kind].append(tail)
                    folder.close()
        base = median(walls["none"])
        for kind in ("local", "bucket"):
            figure(f"save_step_time_ratio {label} {kind}/none", median(walls[kind]) / base, "x",
                   f"({size_mb:.0f} MB per save, {steps // every} saves)")
            figure(f"save_blocked_s {label} {kind}", median(blocks[kind]), "s", "per save, median")
            figure(f"save_final_wait_s {label} {kind}", median(tails[kind]), "s", "the last upload, after the loop")
        figure(f"save_step_time_ratio {label} bucket/local", median(walls["bucket"]) / median(walls["local"]), "x")
        shutil.rmtree(tmp, ignore_errors=True)


def _tensors(obj):
    import torch

    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, dict):
        for v in obj.values():
            yield from _tensors(v)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            yield from _tensors(v)


if __name__ == "__main__":
    main()
