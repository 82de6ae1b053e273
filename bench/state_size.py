"""SogCLR's per-sample state: measured bytes per sample (table and checkpoint), what they come to
at the design size (2.3 B samples, 512 ranks), and the per-step time of its collectives on 2, 3
and 4 CPU processes (gloo).

The table is sharded by owner rank (vlp/losses/sogclr.py): sample k on rank k % world. A step is
a lookup (all_gather of the global batch's ids, then an all_to_all of the old u owners hold) and
a commit (an all_to_all of the new u to their owners); the replicated table it replaces did two
all_gathers (ids, new u) and wrote all of them on every rank. Both are timed step by step.

    OMP_NUM_THREADS=1 .venv/bin/python bench/state_size.py             # ~1 min
    OMP_NUM_THREADS=1 .venv/bin/python bench/state_size.py --quick     # smoke test
"""

from __future__ import annotations

import argparse
import datetime
import io
import os
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench._common import figure, header, median, spread  # noqa: E402

DESIGN_SAMPLES, DESIGN_RANKS = 2_300_000_000, 512


def saved_bytes(obj) -> int:
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.tell()


def measure_sizes(n: int) -> dict:
    """Bytes per sample of one rank's table and of its checkpoint shard, measured at n samples
    (1 and 4 ranks), and of the replicated state of before."""
    from vlp.losses.sogclr import SogCLRLoss

    out = {}
    for world in (1, 4):
        sog = SogCLRLoss(n, rank=0, world_size=world)
        rows = len(sog.table)
        sog.table.write(torch.arange(rows), torch.randn(rows, 2))  # a fully visited shard
        out[world] = (sog.table.bits.nbytes / rows, saved_bytes(sog.state_dict()) / rows,
                      saved_bytes(sog.state_dict()) - 8 * rows)
    replicated = {"log_u": torch.randn(n, 2), "step": 0}
    out["replicated"] = saved_bytes(replicated) / n
    return out


def report_sizes(n: int) -> None:
    m = measure_sizes(n)
    table_b, ckpt_b, overhead = m[1]
    print(f"# measured at N = {n:,} samples (a shard fully written)")
    print(f"{'':34s}{'1 rank':>12s}{'4 ranks':>12s}")
    print(f"{'table bytes / sample held':34s}{m[1][0]:12.3f}{m[4][0]:12.3f}")
    print(f"{'checkpoint bytes / sample held':34s}{m[1][1]:12.3f}{m[4][1]:12.3f}")
    print(f"{'checkpoint fixed overhead (B)':34s}{m[1][2]:12.0f}{m[4][2]:12.0f}")
    print(f"replicated state of before: {m['replicated']:.3f} checkpoint bytes / sample, on every rank")
    n_d, w_d = DESIGN_SAMPLES, DESIGN_RANKS
    rows = -(-n_d // w_d)
    per_rank = table_b * rows
    per_file = 8 * rows + overhead
    print(f"# at N = {n_d:,} samples, W = {w_d} ranks (formulas from the measured bytes)")
    print(f"  sharded:    table per rank = {table_b:.0f} x ceil(N/W) = {per_rank / 1e6:.1f} MB; "
          f"checkpoint = W files of 8 x ceil(N/W) + {overhead:.0f} B = {per_file / 1e6:.1f} MB each, "
          f"{w_d * per_file / 1e9:.1f} GB in all")
    print(f"  replicated: table per rank = 8 x N = {8 * n_d / 1e9:.1f} GB (x {w_d} ranks = "
          f"{8 * n_d * w_d / 1e12:.1f} TB of memory); checkpoint = {m['replicated'] * n_d / 1e9:.1f} GB "
          "in rank 0's file")
    print("  resume on another world size W': a rank reads the saved files shards_needed(rank, W', W) "
          f"(the saved ranks = rank mod gcd(W, W')): 1 file when W' = W, 2 for {w_d} -> {w_d // 2}, "
          f"all {w_d} ({w_d * per_file / 1e9:.1f} GB) when gcd = 1")
    figure("sogclr_table_bytes_per_sample", table_b, "B")
    figure("sogclr_checkpoint_bytes_per_sample", ckpt_b, "B")
    figure("sogclr_table_per_rank_2.3B_512", per_rank / 1e6, "MB", f"replicated: {8 * n_d / 1e9:.1f} GB")
    figure("sogclr_checkpoint_2.3B_512", w_d * per_file / 1e9, "GB", f"{w_d} files of {per_file / 1e6:.1f} MB")


# ---------------------------------------------------------------- collectives (gloo)
def worker(rank: int, world: int, args, tmp: str) -> None:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)
    torch.distributed.init_process_group("gloo", init_method=f"file://{tmp}/rendezvous", rank=rank,
                                         world_size=world, timeout=datetime.timedelta(seconds=300))
    from vlp.losses.sharded import all_gather_ranks
    from vlp.losses.sogclr import SogCLRLoss

    n = args.samples_per_rank * world
    sog = SogCLRLoss(n, rank=rank, world_size=world)
    replicated = torch.full((n, 2), float("-inf"))
    gen = torch.Generator().manual_seed(rank)
    cpu = torch.device("cpu")
    times = {"lookup": [], "commit": [], "sharded step": [], "replicated step": []}
    for step in range(args.warmup + args.steps):
        ids = torch.randint(0, n, (args.batch,), generator=gen)
        new = torch.randn(args.batch, 2, generator=gen)
        torch.distributed.barrier()
        t0 = time.perf_counter()
        looked_up = sog._lookup(ids, cpu)  # all_gather ids + all_to_all of old u
        t1 = time.perf_counter()
        sog.pending = looked_up._replace(new=new)
        sog.commit()  # all_to_all of new u, owners write
        t2 = time.perf_counter()
        torch.distributed.barrier()
        t3 = time.perf_counter()
        _ = replicated[ids]  # the replicated table's read, then its commit: 2 all_gathers, all rows written
        replicated[all_gather_ranks(ids, world)] = all_gather_ranks(new, world)
        t4 = time.perf_counter()
        if step >= args.warmup:
            times["lookup"].append(t1 - t0)
            times["commit"].append(t2 - t1)
            times["sharded step"].append(t2 - t0)
            times["replicated step"].append(t4 - t3)
    gathered = [None] * world
    torch.distributed.all_gather_object(gathered, times)
    if rank == 0:
        worst = {k: [max(r[k][i] for r in gathered) for i in range(args.steps)] for k in times}  # slowest rank
        print(f"# {world} gloo ranks, {args.batch} anchors per rank (global batch {args.batch * world}), "
              f"{n:,} samples; ms per step, slowest rank, median [min..max]")
        for k, xs in worst.items():
            print(f"  {k:16s} {spread([1e3 * x for x in xs])}")
        figure(f"sogclr_collectives_ms world={world}", 1e3 * median(worst["sharded step"]), "ms",
               f"3 collectives; replicated 2 all_gathers: {1e3 * median(worst['replicated step']):.3g} ms")
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=4_000_000, help="N for the byte counts")
    parser.add_argument("--samples-per-rank", type=int, default=1_000_000)
    parser.add_argument("--batch", type=int, default=256, help="anchors per rank")
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--worlds", default="2,3,4")
    parser.add_argument("--quick", action="store_true", help="small N, 5 steps, 2 ranks (smoke test)")
    args = parser.parse_args()
    if args.quick:
        args.samples, args.samples_per_rank, args.steps, args.warmup, args.worlds = 100_000, 10_000, 5, 1, "2"
    header("SogCLR per-sample state: bytes and collectives")
    report_sizes(args.samples)
    import torch.multiprocessing as mp

    for world in [int(w) for w in args.worlds.split(",")]:
        with tempfile.TemporaryDirectory(prefix="vlp_state_size_") as tmp:
            mp.spawn(worker, args=(world, args, tmp), nprocs=world, join=True)


if __name__ == "__main__":
    main()
