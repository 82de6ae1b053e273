"""Soak (issue 20, item 5): the trainer's data path streamed for many minutes and many epochs;
does memory or the open-file count grow with the batches read?

    OMP_NUM_THREADS=1 python bench/soak.py                 # 10 minutes, 4 workers, resampled
    OMP_NUM_THREADS=1 python bench/soak.py --minutes 30
    OMP_NUM_THREADS=1 python bench/soak.py --quick         # 0.5 minute, samples every 5 s

What runs: `vlp.data.stream.make_loader(..., mode="resampled", num_workers=4).epochs()`,
the generator the trainer's `TrainData.stream` iterates (one set of workers for all epochs), over
the OpenMoji train shards (vlp.data.embedded.prepare_shards: 4 shards, 1706 pairs), with
vlp-micro's own train transform and tokenizer (vlp.models.model.build_model) and batch 16, so
an epoch is 106 batches and 10 minutes are hundreds of epochs. No model step (the loader is
what holds files and worker memory; a step would only slow the stream down).

Every --every seconds (default 15) it samples, with psutil: the RSS of the main process, the
RSS of every worker (its children), their USS (pages private to the process: where a leak
shows), the PSS of all of them together (RSS counts pages shared with the parent after fork once
per process; PSS shares them out), and the open file descriptors of the main process and of the
workers. PSS is NOT a leak signal on a shared machine: libtorch's pages are shared with every
other process on the box that maps the same files (venvs hard-linked from one cache), so a
process's PSS rises when other jobs end; read RSS and USS. It prints the series, then the
least-squares slope of each against batches read, per 10k batches, with its standard error
and the bound slope + 2 SE, over the samples after the first minute (warm-up: allocator
arenas, the shuffle buffers filling, page cache) and over all of them.
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench._common import REPO, figure, header, pin_threads  # noqa: E402

MB = 1024 ** 2


def sample(main) -> dict:
    import psutil

    workers = []
    for p in main.children(recursive=True):
        try:
            full = p.memory_full_info()
            workers.append((full.rss, p.num_fds(), full.pss, full.uss))
        except psutil.Error:
            pass
    full = main.memory_full_info()
    return {"main_rss": full.rss / MB, "workers_rss": sum(w[0] for w in workers) / MB,
            "pss": (full.pss + sum(w[2] for w in workers)) / MB, "main_uss": full.uss / MB,
            "workers_uss": sum(w[3] for w in workers) / MB, "main_fds": main.num_fds(),
            "workers_fds": sum(w[1] for w in workers), "workers": len(workers)}


def slope(xs: list[float], ys: list[float]) -> tuple[float, float]:
    """Least-squares slope of ys on xs and its standard error."""
    n = len(xs)
    if n < 3:
        return float("nan"), float("nan")
    mx, my = sum(xs) / n, sum(ys) / n
    sxx = sum((x - mx) ** 2 for x in xs)
    if sxx == 0:
        return float("nan"), float("nan")
    b = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx
    resid = sum((y - my - b * (x - mx)) ** 2 for x, y in zip(xs, ys))
    return b, math.sqrt(resid / (n - 2) / sxx)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--minutes", type=float, default=10.0)
    ap.add_argument("--quick", action="store_true", help="0.5 minute, a sample every 5 s")
    ap.add_argument("--every", type=float, default=15.0, help="seconds between samples")
    ap.add_argument("--workers", type=int, default=4)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--warmup", type=float, default=60.0, help="seconds left out of the 'after warm-up' fit")
    ap.add_argument("--model", default="vlp-micro", help="whose train transform and tokenizer")
    args = ap.parse_args(argv)
    if args.quick:
        args.minutes, args.every, args.warmup = 0.5, 5.0, 10.0
    pin_threads()
    import psutil

    from vlp.data.embedded import prepare_shards
    from vlp.config.keys import DataConfig
    from vlp.data.stream import make_loader
    from vlp.experiment import load_config
    from vlp.models.model import build_model

    spec = prepare_shards(REPO / ".cache" / "shards" / "openmoji")["train"]
    cfg = load_config(REPO / "configs" / "demo.yaml", [f"model.name={args.model}"])
    _, tokenizer, transform, _ = build_model(cfg.model, cfg.loss)
    data = DataConfig(train_shards=spec, batch_per_device=args.batch, num_workers=args.workers, mode="resampled",
                      shuffle_buffer=1000)
    loader = make_loader(data, transform=transform, tokenize=tokenizer, seed=0)
    header(f"soak: {args.minutes:g} min, {args.workers} workers, resampled, batch {args.batch}, "
           f"{loader.num_batches} batches an epoch, {spec}")
    me = psutil.Process()
    rows = []  # (seconds, batches, epoch, sample)
    t0 = time.perf_counter()
    next_at = t0
    batches = 0
    epoch = 0
    items = loader.epochs(0, 0)
    print("|   s | batches | epoch | main RSS MB | workers RSS MB | main USS MB | workers USS MB | PSS all MB "
          "| main fds | worker fds | workers |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    try:
        for item in items:
            batches += 1
            epoch = item["epoch"]
            now = time.perf_counter()
            if now >= next_at:
                s = sample(me)
                rows.append((now - t0, batches, epoch, s))
                print(f"| {now - t0:5.0f} | {batches} | {epoch} | {s['main_rss']:.1f} | {s['workers_rss']:.1f} "
                      f"| {s['main_uss']:.1f} | {s['workers_uss']:.1f} | {s['pss']:.1f} | {s['main_fds']} | {s['workers_fds']} | {s['workers']} |", flush=True)
                next_at += args.every
                if now - t0 >= args.minutes * 60:
                    break
    finally:
        items.close()
    wall = rows[-1][0]
    print(f"\n{batches} batches ({batches * args.batch} samples, {epoch + 1} epochs) in {wall:.0f} s: "
          f"{batches / wall:.1f} batches/s; {len(rows)} samples")
    fits = {"after warm-up": [r for r in rows if r[0] >= args.warmup], "all": rows}
    print("| series | fit over | samples | first | last | slope per 10k batches | SE | bound (slope + 2 SE) |")
    print("|---|---|---|---|---|---|---|---|")
    series = {"main RSS MB": "main_rss", "workers RSS MB": "workers_rss", "main USS MB": "main_uss",
              "workers USS MB": "workers_uss", "PSS all MB": "pss",
              "main fds": "main_fds", "worker fds": "workers_fds"}
    found = []
    for label, key in series.items():
        for fit, sel in fits.items():
            xs = [r[1] / 1e4 for r in sel]
            ys = [float(r[3][key]) for r in sel]
            b, se = slope(xs, ys)
            print(f"| {label} | {fit} | {len(sel)} | {ys[0]:.1f} | {ys[-1]:.1f} | {b:+.3f} | {se:.3f} | {b + 2 * se:+.3f} |")
            if fit == "after warm-up":
                found.append((f"soak_slope_per_10k_batches {key.replace('_', '')}", b,
                              "MB" if "fds" not in key else "fds", f"SE {se:.3g}, bound {b + 2 * se:.3g}"))
    for args_ in found:
        figure(*args_)
    figure("soak_batches", batches)
    figure("soak_epochs", epoch + 1)


if __name__ == "__main__":
    main()
