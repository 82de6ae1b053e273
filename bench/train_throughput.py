"""Training throughput: `python -m vlp train` vs `python -m open_clip_train.main`, same tiny model.

    OMP_NUM_THREADS=1 python bench/train_throughput.py           # 100 steps x 2 systems x 3 rounds (~4 min)
    OMP_NUM_THREADS=1 python bench/train_throughput.py --quick   # vlp-micro, 6 steps x 1 round

Both runs: model vlp-tiny (vlp/models/model_configs/vlp-tiny.json, registered in open_clip_train by a
two-line wrapper: open_clip.add_model_config + runpy), the OpenMoji train shards (vlp.demo),
per-device batch 32, fp32, 1 process, CPU, OMP_NUM_THREADS=1, 1 data-loader worker, the same
number of steps, shuffle buffer 1000 (open_clip_train's initial fill), no eval, no periodic
checkpoint (both still write one at the end: outside the timed window), logs in a temp dir,
a log line every step (vlp: log.jsonl + TensorBoard; open_clip_train: its text log).

Steady state: the per-step times both programs log (vlp: samples_per_s of log.jsonl with
train.log_every=1 = batch / wall time between consecutive steps, data wait included;
open_clip_train: `Batch (t)` samples/s, also data wait included) for steps >= --warmup.
Reported: samples/s = steps * batch / sum(step times) (pass boundaries, where both refill
their shuffle buffer, included) and the median-step rate. Runs alternate (vlp, open_clip,
then rotated); the ratio is per round (side by side), median over rounds.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench._common import (  # noqa: E402
    PYTHON, REPO, alternate, bench_env, figure, header, median, overrides, paired_ratio, run, spread,
)

OPEN_CLIP_WRAPPER = (
    "import sys, runpy, open_clip; open_clip.add_model_config({cfg!r}); "
    "sys.argv = ['open_clip_train.main'] + sys.argv[1:]; "
    "runpy.run_module('open_clip_train.main', run_name='__main__', alter_sys=True)"
)


def openmoji_train_spec() -> str:
    from vlp.data.embedded import prepare_shards

    return prepare_shards(REPO / ".cache" / "shards" / "openmoji")["train"]


def vlp_cmd(spec: str, out: Path, model: str, batch: int, steps: int, workers: int, seed: int = 0,
            lr: float = 1e-3, warmup: int = 10, extra: list[str] | None = None) -> list[str]:
    return [PYTHON, "-m", "vlp", "train", "-c", str(REPO / "configs" / "demo.yaml"), *overrides(
            f"model.name={model}", f"data.train_shards={spec}", f"data.batch_per_device={batch}",
            f"data.num_workers={workers}", "data.shuffle_buffer=1000", f"train.samples={steps * batch}",
            "train.log_every=1", "train.checkpoint_every=0", "train.eval_every=0",
            f"train.output_dir={out}", f"train.seed={seed}", f"optim.lr={lr}",
            f"optim.warmup_steps={warmup}", *(extra or []))]


def open_clip_cmd(spec: str, logs: Path, model: str, batch: int, steps: int, workers: int, seed: int = 0,
                  lr: float = 1e-3, warmup: int = 10, extra: list[str] | None = None) -> list[str]:
    wrapper = OPEN_CLIP_WRAPPER.format(cfg=str(REPO / "vlp" / "models" / "model_configs"))
    return [PYTHON, "-c", wrapper,
            "--model", model, "--train-data", spec, "--dataset-type", "webdataset",
            "--train-num-samples", str(steps * batch), "--batch-size", str(batch), "--epochs", "1",
            "--precision", "fp32", "--device", "cpu", "--workers", str(workers), "--seed", str(seed),
            "--lr", str(lr), "--wd", "0.1", "--beta1", "0.9", "--beta2", "0.98", "--eps", "1e-6",
            "--warmup", str(warmup), "--save-frequency", "0", "--zeroshot-frequency", "0",
            "--val-frequency", "0", "--log-every-n-steps", "1", "--logs", str(logs), "--name", "run",
            *(extra or [])]


def vlp_step_rates(out: Path) -> list[float]:
    rates = []
    for line in (out / "log.jsonl").read_text().splitlines():
        rec = json.loads(line)
        if "samples_per_s" in rec:
            rates.append(float(rec["samples_per_s"]))
    return rates


_OC_RATE = re.compile(r"Batch \(t\): [\d.]+, ([\d.eE+-]+)/s,")


def open_clip_step_rates(logs: Path) -> list[float]:
    text = (logs / "run" / "out.log").read_text()
    return [float(m.group(1)) for m in _OC_RATE.finditer(text)]


def steady(rates: list[float], batch: int, warmup: int) -> tuple[float, float]:
    """(samples/s over steps >= warmup as total samples / total time, median-step samples/s)."""
    tail = rates[warmup:]
    if not tail:
        raise ValueError(f"only {len(rates)} logged steps, warmup {warmup}")
    return len(tail) * batch / sum(batch / r for r in tail), median(tail)


def run_one(system: str, spec: str, args) -> tuple[float, float, int]:
    with tempfile.TemporaryDirectory(prefix=f"bench_{system}_") as tmp:
        tmp = Path(tmp)
        if system.startswith("vlp"):
            cmd = vlp_cmd(spec, tmp / "run", args.model, args.batch, args.steps, args.workers)
            run(cmd, env=bench_env())
            rates = vlp_step_rates(tmp / "run")
        else:
            _, _ = run(open_clip_cmd(spec, tmp, args.model, args.batch, args.steps, args.workers),
                       env=bench_env())
            rates = open_clip_step_rates(tmp)
    if len(rates) != args.steps:
        print(f"# warning: {system} logged {len(rates)} steps, expected {args.steps}")
    mean_rate, median_rate = steady(rates, args.batch, args.warmup)
    return mean_rate, median_rate, len(rates)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--model", default="vlp-tiny")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--warmup", type=int, default=10, help="steps excluded from the steady state")
    ap.add_argument("--workers", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args(argv)
    if args.quick:
        args.model, args.steps, args.warmup, args.rounds = "vlp-micro", 6, 2, 1
    header(f"train throughput: {args.model}, batch {args.batch}, fp32, 1 process, {args.workers} worker, "
           f"{args.steps} steps (steady state from step {args.warmup})")
    spec = openmoji_train_spec()
    print(f"# shards {spec}", flush=True)
    systems = ["vlp", "open_clip_train"]
    results: dict[str, list] = {s: [] for s in systems}

    def measure(system):
        def f():
            mean_rate, median_rate, n = run_one(system, spec, args)
            results[system].append((mean_rate, median_rate))
            print(f"  {system:16s} {mean_rate:8.1f} samples/s (median step {median_rate:8.1f}), {n} steps",
                  flush=True)
            return mean_rate
        return f

    rates = alternate({s: measure(s) for s in systems}, args.rounds)
    print(f"\n## steady-state samples/s, median [min..max] over {args.rounds} rounds")
    for system, xs in rates.items():
        med_steps = [m for _, m in results[system]]
        print(f"  {system:16s} {spread(xs)}   median-step rate {spread(med_steps)}")
        figure(f"train_samples_per_s {system}", median(xs), "samples/s")
    r = paired_ratio(rates["vlp"], rates["open_clip_train"])
    figure("train_ratio vlp/open_clip_train", median(r), "x", f"[{min(r):.3f}..{max(r):.3f}]")
    r2 = paired_ratio([m for _, m in results["vlp"]], [m for _, m in results["open_clip_train"]])
    figure("train_ratio_median_step vlp/open_clip_train", median(r2), "x", f"[{min(r2):.3f}..{max(r2):.3f}]")


if __name__ == "__main__":
    main()
