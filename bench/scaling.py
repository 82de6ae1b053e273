"""Data-parallel scaling on CPU: `vlp train` in 1 process vs 2 processes (gloo), global samples/s.

    OMP_NUM_THREADS=1 python bench/scaling.py           # vlp-tiny, 60 steps, 3 rounds (~4 min)
    OMP_NUM_THREADS=1 python bench/scaling.py --quick   # vlp-micro, 6 steps, 1 round

1 process:   python -m vlp train ...
2 processes: ACCELERATE_USE_CPU=1 accelerate launch --config_file launch/cpu_2proc.yaml
             --main_process_port <free> -m vlp train ...   (the run must report "x 2 processes")
Same config, per-process batch 32 (so the global batch is 32 vs 64), 0 loader workers (the
2-process run already has one process per core), OMP_NUM_THREADS=1 per process, same steps.
Global samples/s from log.jsonl (written by rank 0: global batch / wall time per step) over
steps >= --warmup. On this 2-core machine this measures the overhead of the gloo gather,
the DDP all-reduce and two processes sharing the cores (and memory bandwidth), not how
GPUs scale: the ideal here is 2x only if each process had a whole idle core.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench._common import (  # noqa: E402
    PYTHON, REPO, alternate, bench_env, figure, free_port, header, median, paired_ratio, run, spread,
)
from bench.train_throughput import openmoji_train_spec, steady, vlp_cmd, vlp_step_rates  # noqa: E402


def run_vlp(procs: int, spec: str, args) -> float:
    with tempfile.TemporaryDirectory(prefix=f"bench_scaling{procs}_") as tmp:
        out = Path(tmp) / "run"
        # train.samples = steps x global batch, so both runs take the same number of steps
        cmd = vlp_cmd(spec, out, args.model, args.batch * procs, args.steps, workers=0)
        cmd = [c if not c.startswith("data.batch_per_device=") else f"data.batch_per_device={args.batch}"
               for c in cmd]
        env = bench_env()
        if procs == 2:
            env["ACCELERATE_USE_CPU"] = "1"  # launch/cpu_2proc.yaml is the MULTI_GPU twin on CPU
            accelerate = [PYTHON, "-m", "accelerate.commands.launch", "--config_file",
                          str(REPO / "launch" / "cpu_2proc.yaml"), "--main_process_port", str(free_port())]
            cmd = accelerate + cmd[1:]  # drop the python executable: launch runs `-m vlp`
        _, log = run(cmd, env=env)
        if f"x {procs} processes" not in log:
            raise RuntimeError(f"expected {procs} processes, the run says:\n{log[-2000:]}")
        rates = vlp_step_rates(out)
    global_batch = args.batch * procs
    rate, _ = steady(rates, global_batch, args.warmup)
    print(f"  {procs} process(es): {rate:8.1f} global samples/s ({len(rates)} steps)", flush=True)
    return rate


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--model", default="vlp-tiny")
    ap.add_argument("--batch", type=int, default=32, help="per-process batch")
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--warmup", type=int, default=10)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args(argv)
    if args.quick:
        args.model, args.steps, args.warmup, args.rounds = "vlp-micro", 6, 2, 1
    header(f"scaling: {args.model}, per-process batch {args.batch}, 1 vs 2 CPU processes, {args.steps} steps")
    spec = openmoji_train_spec()
    rates = alternate({"1proc": lambda: run_vlp(1, spec, args), "2proc": lambda: run_vlp(2, spec, args)},
                      args.rounds)
    for name, xs in rates.items():
        print(f"  {name}: {spread(xs)} global samples/s")
        figure(f"scaling_samples_per_s {name}", median(xs), "samples/s")
    r = paired_ratio(rates["2proc"], rates["1proc"])
    figure("scaling_ratio 2proc/1proc", median(r), "x", f"[{min(r):.3f}..{max(r):.3f}] (ideal 2.0 with 2 idle cores)")


if __name__ == "__main__":
    main()
