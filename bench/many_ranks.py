"""Many ranks on one CPU box (issue 20, item 4): `vlp train` on N gloo processes, DDP and FSDP,
with checkpoints, an exact resume after SIGKILL and a resume_mode=continue on 3 processes; and
the per-step cost of vlp's own collectives at 2, 4 and 8 ranks.

    OMP_NUM_THREADS=1 python bench/many_ranks.py                 # 8 ranks, ddp + fsdp, collectives 2/4/8
    OMP_NUM_THREADS=1 python bench/many_ranks.py --ranks 16      # also try 16 ranks (memory permitting)
    OMP_NUM_THREADS=1 python bench/many_ranks.py --quick         # 2 ranks, a few steps (smoke)
    OMP_NUM_THREADS=1 python bench/many_ranks.py --only collectives --iters 400
    OMP_NUM_THREADS=1 python bench/many_ranks.py --only rounding      # why DDP's resume drifts at >= 3 ranks

Part 1, training (`--only train`): for each of train.parallel=ddp and fsdp

    ACCELERATE_USE_CPU=1 accelerate launch --config_file launch/cpu_2proc.yaml --num_processes N
        --main_process_port P -m vlp train -c configs/demo.yaml model.name=vlp-micro
        data.batch_per_device=2 data.num_workers=0 train.parallel=MODE train.checkpoint_every=K ...

  full:     uninterrupted, S steps, a checkpoint every K;
  killed:   the same run, SIGKILL of the whole process group once step_K exists, then
            `train.resume=latest`: its open_clip_model.pt must be bit-identical to full's;
  continue: full's folder cut back to step K, resumed on 3 processes with
            train.resume_mode=continue (other global batch): must finish the sample budget.
  Peak RSS of each rank (sum of a rank's process tree, sampled every 0.2 s with psutil) and of
  the whole job are printed; the launcher process is not counted in the per-rank figure.

Part 2, collectives (`--only collectives`): torch.multiprocessing gloo workers (file
rendezvous, as tests/support/dist_utils.py), OMP_NUM_THREADS=1, for world 2, 4, 8:

  gather      vlp.distributed.gather_with_grad of (b, d) image and text features + backward
              (the trainer's two gathers per step; b=2, d=32: vlp-micro at batch 2)
  sogclr      vlp.losses.sogclr.SogCLRLoss lookup (ids all_gather + all_to_all) and commit
              (all_to_all) of one step (the private _lookup/commit pair, no loss math)
  skip_counts vlp.distributed.gather_object([skip-count dict])      (once per logged step)
  nonfinite   vlp.distributed.all_reduce of a 1-element flag + .item() (once per step)
  ckpt_meta   gather_object([{rng state, data state}])              (once per checkpoint)

  Each iteration: barrier, then the op timed on every rank; the iteration's figure is the
  slowest rank's wall time (what the step waits for), and the CPU time summed over ranks
  (time.process_time, the work the collective costs the machine). Medians over --iters.
  On 2 cores, 4 and 8 ranks are oversubscribed (2x, 4x): the wall figure then includes the
  scheduler handing the cores round (each hop of a ring waits for its peer to be scheduled), so
  the raw wall ratio is about (world ratio) x (oversubscription ratio); the column
  "wall / (ranks per core)" divides the oversubscription out and is the one to compare with the
  world size. The CPU-time total is printed too (it also grows with context switching).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench._common import PYTHON, REPO, bench_env, figure, free_port, header, median, overrides  # noqa: E402

GIB = 1024 ** 3
GUARD_BYTES = 1.5 * GIB  # a launch is killed when the machine has less available than this


# ============================================================================ part 1: training
class RssSampler:
    """Peak RSS per rank process tree (children of the launcher) and of the whole job."""

    def __init__(self, root_pid: int, every_s: float = 0.2):
        self.root_pid, self.every_s = root_pid, every_s
        self.per_rank: dict[int, int] = {}  # pid of a rank (a child of the launcher) -> peak bytes
        self.job_peak = 0
        self.launcher_peak = 0
        self.job_pss_peak = 0  # the job's real footprint: PSS splits shared pages (libtorch...) between processes
        self.min_available = float("inf")  # the machine's available memory, lowest seen
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self):
        import psutil

        last_pss = 0.0
        while not self._stop.is_set():
            try:
                root = psutil.Process(self.root_pid)
                if time.monotonic() - last_pss > 1.0:  # PSS (smaps) once a second: shared pages shared out
                    last_pss = time.monotonic()
                    pss = 0
                    for p in [root] + root.children(recursive=True):
                        try:
                            pss += p.memory_full_info().pss
                        except psutil.Error:
                            pass
                    self.job_pss_peak = max(self.job_pss_peak, pss)
                launcher = root.memory_info().rss
                total = launcher
                for child in root.children():
                    tree = [child] + child.children(recursive=True)
                    rss = 0
                    for p in tree:
                        try:
                            rss += p.memory_info().rss
                        except psutil.Error:
                            pass
                    total += rss
                    self.per_rank[child.pid] = max(self.per_rank.get(child.pid, 0), rss)
                self.job_peak = max(self.job_peak, total)
                self.launcher_peak = max(self.launcher_peak, launcher)
                self.min_available = min(self.min_available, psutil.virtual_memory().available)
            except psutil.Error:
                pass
            self._stop.wait(self.every_s)

    def stop(self):
        self._stop.set()
        self._thread.join()


def launch_cmd(nproc: int, spec: str, out: Path, mode: str, steps: int, every: int, extra=()) -> list[str]:
    return [PYTHON, "-m", "accelerate.commands.launch", "--config_file", str(REPO / "launch" / "cpu_2proc.yaml"),
            "--num_processes", str(nproc), "--main_process_port", str(free_port()),
            "-m", "vlp", "train", "-c", str(REPO / "configs" / "demo.yaml"), *overrides(
            "model.name=vlp-micro", f"data.train_shards={spec}", "data.eval_shards=",
            "data.batch_per_device=2", "data.num_workers=0", "data.shuffle_buffer=64",
            f"train.samples={steps * 2 * nproc}", "train.log_every=1", f"train.checkpoint_every={every}",
            "train.keep_last=0", "train.eval_every=0", f"train.parallel={mode}", f"train.output_dir={out}",
            "optim.lr=1e-3", "optim.warmup_steps=2", *extra)]


def kill_job(launcher_pid: int) -> None:
    """SIGKILL the launcher and every rank at once. torch.distributed.elastic starts each rank
    in its own session, so killpg(launcher) alone kills only the launcher: the ranks would then
    stop ~1 s later through vlp.distributed.exit_with_launcher, free to write one more checkpoint.
    Here every process of the job gets SIGKILL, ranks first (by pid: these are our children)."""
    import psutil

    try:
        tree = psutil.Process(launcher_pid).children(recursive=True)
    except psutil.Error:
        tree = []
    for p in tree:
        try:
            p.send_signal(signal.SIGKILL)
        except psutil.Error:
            pass
    os.killpg(launcher_pid, signal.SIGKILL)
    psutil.wait_procs(tree, timeout=10)


def run_job(cmd: list[str], log: Path, timeout: float, kill_when: Path | None = None) -> dict:
    """Run one launch (its own session), sampling RSS; SIGKILL its process group once
    ``kill_when`` exists. Returns {rc, wall_s, rank_peak_gib (list), job_peak_gib, killed}."""
    env = bench_env(ACCELERATE_USE_CPU="1")
    t0 = time.perf_counter()
    with open(log, "w") as fh:
        proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=fh, stderr=subprocess.STDOUT,
                                start_new_session=True)
        sampler = RssSampler(proc.pid)
        killed = False
        deadline = time.monotonic() + timeout
        while proc.poll() is None:
            if kill_when is not None and kill_when.exists():
                kill_job(proc.pid)
                killed = True
                break
            if sampler.min_available < GUARD_BYTES:
                kill_job(proc.pid)
                proc.wait()
                sampler.stop()
                raise RuntimeError(f"stopped: the machine's available memory fell below {GUARD_BYTES / GIB:.1f} GiB "
                                   f"(job at {sampler.job_peak / GIB:.1f} GiB, {len(sampler.per_rank)} ranks seen)")
            if time.monotonic() > deadline:
                kill_job(proc.pid)
                proc.wait()
                sampler.stop()
                raise RuntimeError(f"timed out after {timeout:.0f}s: {' '.join(cmd)}\n{log.read_text()[-3000:]}")
            time.sleep(0.05)
        proc.wait()
        sampler.stop()
    wall = time.perf_counter() - t0
    if not killed and proc.returncode != 0:
        raise RuntimeError(f"rc={proc.returncode}: {' '.join(cmd)}\n{log.read_text()[-4000:]}")
    return {"rc": proc.returncode, "wall_s": wall, "killed": killed, "min_available_gib": sampler.min_available / GIB,
            "job_pss_gib": sampler.job_pss_peak / GIB,
            "rank_peak_gib": sorted((v / GIB for v in sampler.per_rank.values()), reverse=True),
            "job_peak_gib": sampler.job_peak / GIB, "launcher_gib": sampler.launcher_peak / GIB}


def _weights(run: Path) -> dict:
    import torch

    return torch.load(run / "open_clip_model.pt", weights_only=True, map_location="cpu")["state_dict"]


def _compare(a: Path, b: Path) -> tuple[bool, float]:
    import torch

    wa, wb = _weights(a), _weights(b)
    same = wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)
    worst = max((wa[k] - wb[k]).abs().max().item() for k in wa) if wa.keys() == wb.keys() else float("inf")
    return same, worst


def _ckpt_name(step: int, mode: str) -> str:
    return f"step_{step:08d}" + (".pt" if mode == "ddp" else "")


def _cut_back(run: Path, step: int) -> None:
    """Delete checkpoints after ``step`` (and their manifests / rank folders) and the final export."""
    for p in (run / "checkpoints").iterdir():
        s = int(p.name.split("_")[1].split(".")[0])
        if s > step:
            shutil.rmtree(p) if p.is_dir() else p.unlink()
    for name in ("open_clip_model.pt", "result.json"):
        if (run / name).exists():
            (run / name).unlink()


def _result(run: Path) -> dict:
    return json.loads((run / "result.json").read_text())


def train_case(nproc: int, mode: str, spec: str, root: Path, steps: int, every: int, timeout: float,
               full_only: bool = False) -> dict:
    """full, killed+resumed, continue-on-3 for one (N, mode); returns the row's figures."""
    row: dict = {"ranks": nproc, "mode": mode}
    full, killed, cont = root / f"{mode}{nproc}_full", root / f"{mode}{nproc}_killed", root / f"{mode}{nproc}_cont3"
    r = run_job(launch_cmd(nproc, spec, full, mode, steps, every), root / f"{full.name}.log", timeout)
    text = (root / f"{full.name}.log").read_text()
    if f"x {nproc} processes" not in text:
        raise RuntimeError(f"expected {nproc} processes:\n{text[-2000:]}")
    res = _result(full)
    row.update(full_wall_s=r["wall_s"], rank_peak_gib=max(r["rank_peak_gib"]), rank_min_gib=min(r["rank_peak_gib"]),
               ranks_seen=len(r["rank_peak_gib"]), job_peak_gib=r["job_peak_gib"], steps=res["step"],
               global_batch=res["global_batch"], min_available_gib=r["min_available_gib"], job_pss_gib=r["job_pss_gib"])
    print(f"  {mode} x{nproc} full: {r['wall_s']:.1f}s, {res['step']} steps, global batch {res['global_batch']}, "
          f"peak RSS per rank {min(r['rank_peak_gib']):.2f}..{max(r['rank_peak_gib']):.2f} GiB "
          f"({len(r['rank_peak_gib'])} ranks), job {r['job_peak_gib']:.2f} GiB RSS / {r['job_pss_gib']:.2f} GiB PSS, machine's available memory "
          f"down to {r['min_available_gib']:.1f} GiB", flush=True)

    if full_only:
        return row

    # SIGKILL after the first checkpoint, then resume=latest
    target = killed / "checkpoints" / _ckpt_name(every, mode)
    cmd = launch_cmd(nproc, spec, killed, mode, steps, every)
    k = run_job(cmd, root / f"{killed.name}.log", timeout, kill_when=target)
    time.sleep(2)  # nothing of the job may write on: the listing must not change
    latest = sorted(p.name for p in (killed / "checkpoints").iterdir() if not p.name.endswith(".json"))
    if not k["killed"]:
        raise RuntimeError(f"the run ended before {target.name} appeared: nothing was killed")
    r2 = run_job(launch_cmd(nproc, spec, killed, mode, steps, every, ["train.resume=latest"]),
                 root / f"{killed.name}_resume.log", timeout)
    resumed_line = next((ln for ln in (root / f"{killed.name}_resume.log").read_text().splitlines()
                         if "resumed from" in ln), "")
    same, worst = _compare(full, killed)
    row.update(killed=k["killed"], kill_ckpts=latest, resumed=bool(resumed_line), bit_identical=same,
               max_diff=worst, resume_wall_s=r2["wall_s"])
    print(f"  {mode} x{nproc} SIGKILL with {latest} on disk -> resume=latest: "
          f"{resumed_line.strip()[:120]!r}; bit-identical to full: {same} (max |diff| {worst:.1e})", flush=True)

    # continue on 3 processes from full's step-`every` checkpoint
    shutil.copytree(full, cont)
    _cut_back(cont, every)
    r3 = run_job(launch_cmd(3, spec, cont, mode, steps, every,
                            [f"train.samples={steps * 2 * nproc}", "train.resume=latest",
                             "train.resume_mode=continue"]), root / f"{cont.name}.log", timeout)
    log3 = (root / f"{cont.name}.log").read_text()
    res3 = _result(cont)
    ok3 = "resumed from" in log3 and "x 3 processes" in log3 and res3["samples_seen"] >= steps * 2 * nproc - 6 \
        if "samples_seen" in res3 else "resumed from" in log3
    row.update(cont_ok=bool(ok3), cont_steps=res3["step"], cont_global_batch=res3["global_batch"],
               cont_samples=res3.get("samples_seen"), cont_wall_s=r3["wall_s"])
    print(f"  {mode} x{nproc} -> 3 processes, resume_mode=continue from step {every}: ok={ok3}, final step "
          f"{res3['step']} at global batch {res3['global_batch']}, samples_seen {res3.get('samples_seen')}", flush=True)
    return row


def part_train(args) -> list[dict]:
    from vlp.data.embedded import prepare_shards

    spec = prepare_shards(REPO / ".cache" / "shards" / "openmoji")["train"]
    rows = []
    with tempfile.TemporaryDirectory(prefix="bench_many_ranks_") as tmp:
        root = Path(tmp)
        for nproc in args.ranks:
            for mode in args.modes:
                try:
                    rows.append(train_case(nproc, mode, spec, root, args.steps, args.every, args.timeout,
                                           nproc in args.full_only))
                except Exception as e:  # a failing case is a finding: print it, go on
                    msg = str(e).strip().splitlines()
                    print(f"  {mode} x{nproc} FAILED: {msg[0][:300] if msg else e!r}", flush=True)
                    print("    " + "\n    ".join(msg[-25:]), flush=True)
                    rows.append({"ranks": nproc, "mode": mode, "error": msg[-1][:200] if msg else repr(e)})
        if args.keep:
            shutil.copytree(root, args.keep, dirs_exist_ok=True)
    print("\n| ranks | parallel | steps x global batch | full run s | peak RSS / rank GiB | job peak GiB "
          "| job peak PSS GiB | SIGKILL+resume bit-identical | continue on 3 (steps, batch) |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        if "error" in r:
            print(f"| {r['ranks']} | {r['mode']} | FAILED: {r['error']} | | | | | | |")
            continue
        head = (f"| {r['ranks']} | {r['mode']} | {r['steps']} x {r['global_batch']} | {r['full_wall_s']:.0f} "
                f"| {r['rank_min_gib']:.2f}–{r['rank_peak_gib']:.2f} | {r['job_peak_gib']:.1f} | {r['job_pss_gib']:.1f} ")
        if "bit_identical" not in r:
            print(head + "| not run | not run |")
            continue
        print(head + f"| {'yes' if r['bit_identical'] else 'NO (%.1e)' % r['max_diff']} (killed with "
              f"{', '.join(r['kill_ckpts'])}) | {'ok' if r['cont_ok'] else 'NO'} ({r['cont_steps']}, "
              f"{r['cont_global_batch']}) |")
    for r in rows:
        if "error" not in r:
            figure(f"many_ranks_peak_rss_gib {r['mode']}{r['ranks']}", r["rank_peak_gib"], "GiB")
        if "bit_identical" in r:
            figure(f"many_ranks_bit_identical {r['mode']}{r['ranks']}", float(r["bit_identical"]))
            figure(f"many_ranks_continue3_ok {r['mode']}{r['ranks']}", float(r["cont_ok"]))
    return rows


# ============================================================================ part 2: collectives
def _meta_entry(rank: int) -> dict:
    """A rank's {rng, data} as the trainer gathers it in meta_state: the real RNG state and a
    data state of a real resampled/split loader's shape (rest_of_epoch with a churned shuffle
    buffer of 64: 3 headers + 1 worker x (2 + 64) pieces, ~the size FINDINGS.md quotes)."""
    from vlp.train.parts import RNG

    rest = [(0, 0, 0), (0, 0, 0), (0, 0, 0), (0, rank * 1000 + 37, rank * 1000 + 1000)] + \
        [(i % 4, 100 + i, 101 + i) for i in range(65)]
    return {"rng": RNG().state_dict(),
            "data": {"epoch": 3, "batch_in_epoch": 417, "epoch_pieces": None, "epoch_batches": 1000,
                     "rest": rest, "skipped": {"corrupt_image": rank, "missing_caption": 2}}}


def _collective_worker(rank: int, world: int, tmp: str, iters: int, warm: int, b: int, d: int) -> None:
    os.environ["OMP_NUM_THREADS"] = "1"
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{os.path.join(tmp, 'rendezvous')}", rank=rank,
                            world_size=world, timeout=datetime.timedelta(seconds=300))
    from vlp.distributed import all_reduce, gather_object, gather_with_grad
    from vlp.losses.sogclr import SogCLRLoss

    torch.manual_seed(rank)
    num_samples = 100_000
    sog = SogCLRLoss(num_samples, gamma=0.9, rank=rank, world_size=world)
    # each iteration's global batch: distinct random ids (same on every rank, drawn before the
    # timing), spread over all owners; this rank takes its b of them
    steps = warm + iters
    perm = torch.randperm(num_samples, generator=torch.Generator().manual_seed(1234))[:steps * b * world]
    step_ids = [perm[i * b * world:(i + 1) * b * world].view(world, b)[rank].clone() for i in range(steps)]
    it = 0
    meta = _meta_entry(rank)
    skipped = {"corrupt_image": rank % 3, "missing_caption": 1}

    def op_gather():
        img = torch.randn(b, d, requires_grad=True)
        txt = torch.randn(b, d, requires_grad=True)
        gi, gt = gather_with_grad(img), gather_with_grad(txt)
        (gi @ gt.T).sum().backward()

    def op_sogclr():
        p = sog._lookup(step_ids[it], torch.device("cpu"))
        sog.pending = p._replace(new=p.old.clone())
        sog.commit()

    def op_skip():
        gather_object([dict(skipped)])

    def op_nonfinite():
        bool(all_reduce(torch.zeros(1)).item() != 0)

    def op_meta():
        gather_object([meta])

    ops = {"gather": op_gather, "sogclr": op_sogclr, "skip_counts": op_skip, "nonfinite": op_nonfinite,
           "ckpt_meta": op_meta}
    times = {name: [] for name in ops}
    for it in range(steps):
        for name, fn in ops.items():  # interleaved: slow drift hits every op alike
            dist.barrier()
            w0, c0 = time.perf_counter(), time.process_time()
            fn()
            w1, c1 = time.perf_counter(), time.process_time()
            if it >= warm:
                times[name].append((w1 - w0, c1 - c0))
    torch.save(times, os.path.join(tmp, f"times{rank}.pt"))
    dist.barrier()
    dist.destroy_process_group()


def run_collectives(world: int, iters: int, warm: int, b: int, d: int) -> dict[str, dict[str, float]]:
    import torch
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory(prefix="vlp_coll_") as tmp:
        mp.spawn(_collective_worker, args=(world, tmp, iters, warm, b, d), nprocs=world, join=True)
        per_rank = [torch.load(os.path.join(tmp, f"times{r}.pt")) for r in range(world)]
    out = {}
    for name in per_rank[0]:
        walls = [max(per_rank[r][name][i][0] for r in range(world)) for i in range(iters)]
        cpus = [sum(per_rank[r][name][i][1] for r in range(world)) for i in range(iters)]
        out[name] = {"wall_ms": 1e3 * median(walls), "cpu_ms": 1e3 * median(cpus),
                     "wall_p90_ms": 1e3 * sorted(walls)[int(0.9 * (len(walls) - 1))]}
    return out


def part_collectives(args) -> dict:
    cores = os.cpu_count() or 1
    results = {}
    for world in args.worlds:
        t0 = time.perf_counter()
        results[world] = run_collectives(world, args.iters, args.warm, args.b, args.d)
        print(f"  world {world}: {args.iters} iterations of each op in {time.perf_counter() - t0:.0f}s", flush=True)
    base = args.worlds[0]
    print(f"\nPer-step cost of vlp's collectives (gloo, CPU, b={args.b}, d={args.d}; median of {args.iters}; "
          f"{cores} cores: world > {cores} is oversubscribed)")
    over = lambda w: max(1.0, w / cores)  # processes per core
    print("| collective | world | x world | wall ms (slowest rank) | p90 ms | wall ratio | wall / (ranks per core) ms "
          "| its ratio | CPU ms, all ranks | CPU ratio | CPU ms per rank |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for name in results[base]:
        for world in args.worlds:
            r, r0 = results[world][name], results[base][name]
            norm, norm0 = r["wall_ms"] / over(world), r0["wall_ms"] / over(base)
            print(f"| {name} | {world}{' (%.0fx over)' % (world / cores) if world > cores else ''} "
                  f"| {world / base:.0f}x | {r['wall_ms']:.3f} | {r['wall_p90_ms']:.3f} "
                  f"| {r['wall_ms'] / r0['wall_ms']:.2f}x | {norm:.3f} | {norm / norm0:.2f}x "
                  f"| {r['cpu_ms']:.3f} | {r['cpu_ms'] / r0['cpu_ms']:.2f}x | {r['cpu_ms'] / world:.3f} |")
    for name in results[base]:
        for world in args.worlds:
            figure(f"collective_wall_ms {name}@{world}", results[world][name]["wall_ms"], "ms")
        top = args.worlds[-1]
        figure(f"collective_wall_ratio {name} {top}/{base}", results[top][name]["wall_ms"] / results[base][name]["wall_ms"],
               "x", f"world ratio {top / base:.0f}x")
        figure(f"collective_cpu_ratio {name} {top}/{base}", results[top][name]["cpu_ms"] / results[base][name]["cpu_ms"],
               "x", f"world ratio {top / base:.0f}x")
    return results


# ============================================================================ part 3: why DDP drifts
def _offset_worker(rank: int, world: int, tmp: str, out: list) -> None:
    os.environ["OMP_NUM_THREADS"] = "1"
    import copy

    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    dist.init_process_group("gloo", init_method=f"file://{os.path.join(tmp, 'rendezvous')}", rank=rank,
                            world_size=world, timeout=datetime.timedelta(seconds=120))
    x = torch.randn(4096, generator=torch.Generator().manual_seed(100 + rank))
    a = x.clone()
    dist.all_reduce(a)
    b = torch.cat([torch.zeros(1000), x])
    dist.all_reduce(b)  # the same values 1000 elements further into the buffer
    result = {"offset_diff": float((a - b[1000:]).abs().max())}
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Embedding(500, 32), torch.nn.Flatten(), torch.nn.Linear(128, 64),
                              torch.nn.ReLU(), torch.nn.Linear(64, 8))
    g = torch.Generator().manual_seed(rank)
    batches = [(torch.randint(0, 500, (4, 4), generator=g), torch.randn(4, 8, generator=g)) for _ in range(4)]

    def train(model, steps, find_unused):
        ddp = DDP(model, find_unused_parameters=find_unused)  # a fresh wrapper: what a resumed process builds
        opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
        for xb, yb in steps:
            opt.zero_grad()
            ((ddp(xb) - yb) ** 2).mean().backward()
            opt.step()

    for find_unused in (False, True):
        whole, part = copy.deepcopy(net), copy.deepcopy(net)
        train(whole, batches, find_unused)  # 4 steps, one wrapper
        train(part, batches[:2], find_unused)  # 2 steps, then a new wrapper for the other 2
        train(part, batches[2:], find_unused)
        result[f"ddp_resume_diff find_unused={find_unused}"] = max(
            (p - q).abs().max().item() for p, q in zip(whole.parameters(), part.parameters()))
    if rank == 0:
        torch.save(result, os.path.join(tmp, "rounding.pt"))
    dist.barrier()
    dist.destroy_process_group()


def part_rounding(args) -> None:
    """gloo's all-reduce sum depends on an element's offset at >= 3 ranks, and DDP rebuilds its
    buckets after a process's first backward: a resumed DDP run's first step rounds differently."""
    import torch
    import torch.multiprocessing as mp

    print("\n| world | gloo all_reduce: max diff, same values at offset 0 vs 1000 | DDP 2+2 steps (new wrapper) vs 4: "
          "max weight diff | same with find_unused_parameters=True (no bucket rebuild) |\n|---|---|---|---|")
    for world in args.rounding_worlds:
        with tempfile.TemporaryDirectory(prefix="vlp_round_") as tmp:
            mp.spawn(_offset_worker, args=(world, tmp, []), nprocs=world, join=True)
            r = torch.load(os.path.join(tmp, "rounding.pt"))
        print(f"| {world} | {r['offset_diff']:.2e} | {r['ddp_resume_diff find_unused=False']:.2e} "
              f"| {r['ddp_resume_diff find_unused=True']:.2e} |", flush=True)
        figure(f"rounding_ddp_resume_diff {world}", r["ddp_resume_diff find_unused=False"])


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="2 ranks, 4 steps, ddp; collectives at 2 ranks, 30 iters")
    ap.add_argument("--only", choices=("train", "collectives", "rounding"), default=None)
    ap.add_argument("--rounding-worlds", type=int, nargs="+", default=[2, 3, 8])
    ap.add_argument("--ranks", type=int, nargs="+", default=[8], help="world sizes of the training runs")
    ap.add_argument("--modes", nargs="+", default=["ddp", "fsdp"])
    ap.add_argument("--full-only", type=int, nargs="*", default=[],
                    help="world sizes run uninterrupted only (no SIGKILL/resume/continue), e.g. 16")
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--every", type=int, default=4, help="train.checkpoint_every")
    ap.add_argument("--timeout", type=float, default=900, help="seconds per launch")
    ap.add_argument("--keep", type=Path, default=None, help="copy the run folders and logs here")
    ap.add_argument("--worlds", type=int, nargs="+", default=[2, 4, 8])
    ap.add_argument("--iters", type=int, default=300)
    ap.add_argument("--warm", type=int, default=20)
    ap.add_argument("--b", type=int, default=2, help="per-rank batch of the gathered features")
    ap.add_argument("--d", type=int, default=32, help="feature width (vlp-micro: 32)")
    args = ap.parse_args(argv)
    if args.quick:
        args.ranks, args.modes, args.steps, args.every = [2], ["ddp"], 4, 2
        args.worlds, args.iters, args.warm, args.rounding_worlds = [2], 30, 5, [2, 3]
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    header(f"many ranks: training at {args.ranks} ranks ({'/'.join(args.modes)}), collectives at {args.worlds}")
    if args.only in (None, "train"):
        part_train(args)
    if args.only in (None, "collectives"):
        part_collectives(args)
    if args.only in (None, "rounding"):
        part_rounding(args)


if __name__ == "__main__":
    main()
