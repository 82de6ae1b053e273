"""Images/s of ONE data-loader worker: vlp's stream vs open_clip_train's get_wds_dataset.

    OMP_NUM_THREADS=1 python bench/data_loading.py           # 2000 x 512 px JPEGs, 5 rounds (~6 min)
    OMP_NUM_THREADS=1 python bench/data_loading.py --quick   # 256 JPEGs, 1 round (< 40 s)

Same synthetic JPEG shards (smooth random gradients + noise, 512 px, quality 90; written once
under .cache/bench/), same transform object (open_clip.image_transform(224, is_train=True):
RandomResizedCrop 224 + ToTensor + Normalize), same tokenizer (ViT-B-32's), batch 32, one
DataLoader worker each, shuffled training mode with a 1000-sample shuffle buffer on both sides.

Systems, alternated each round (A B C D, then rotated):
  vlp           vlp.data.stream.make_loader(mode="split", num_workers=1, image_output="region"):
                the default path when the model is on a GPU. Crop-first JPEG decode (the
                RandomResizedCrop box drawn from the header size, the JPEG decoded at the
                smallest DCT scale keeping the box >= 224 px: 512 px sources decode at 256 px),
                and the worker ships the uint8 pixels covering the box and the box; the resize,
                float conversion and normalisation run on the device (vlp/data/device.py)
  vlp_uint8     the same, image_output="uint8": the worker also resizes (PIL), ships the uint8
                224 px crop; the default on CPU (the device only converts and normalises)
  vlp_float     the same, image_output="float": the whole transform in the worker, float32
                (the default before uint8 batches)
  open_clip     open_clip_train.data.get_wds_dataset(args, transform, is_train=True) (wds pipeline,
                WebLoader, 1 worker)

Printed beside them, as the limit: the decode-only rate of the same JPEGs in this process, one
thread (process CPU time), measured right after each vlp run (the same load): `decode_dct` the
worker's decode (header, box, DCT-scaled decode, RGB), `decode_full` PIL's full decode; and
`data_ratio_cpu vlp/decode_dct`, per round (the load-robust figure: how close the worker gets
to decoding alone).

A run times batches [skip, skip + n) after the first `skip` batches (worker start and the
shuffle-buffer fill excluded), so the figure is the worker's steady production rate (the
main process only receives). Images per worker-CPU-second: psutil user+system time of the
worker process, read when it has filled its prefetch queue and waits (before the first timed
batch and after the last), so the window holds exactly the work of the n batches, whatever
else takes the core; it still grows with load (a shared core's caches), so compare figures of
one run. Ratios are per round, median over rounds.
"""

from __future__ import annotations

import argparse
import gc
from collections import Counter
import os
import sys
import time
from argparse import Namespace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench._common import (  # noqa: E402
    REPO, alternate, figure, header, jpeg_shards, median, paired_ratio, pin_threads, spread,
)

BATCH = 32
SYSTEMS = ("vlp", "vlp_uint8", "vlp_float", "open_clip")


def _children_cpu() -> dict[int, float]:
    """{pid: user + system CPU seconds} of this process's children (the loader worker)."""
    import psutil

    out = {}
    for child in psutil.Process().children(recursive=True):
        try:
            t = child.cpu_times()
            out[child.pid] = t.user + t.system
        except psutil.Error:
            pass
    return out


def settled_cpu(quiet: float = 0.3, timeout: float = 20.0) -> dict[int, float]:
    """The worker's CPU seconds once they stop growing for ``quiet`` s: it has filled its
    prefetch queue and waits for the main process, so a window between two such readings holds
    exactly the work of the batches taken in it."""
    last, changed = _children_cpu(), time.perf_counter()
    start = changed
    while time.perf_counter() - start < timeout:
        time.sleep(0.05)
        now = _children_cpu()
        if now != last:
            last, changed = now, time.perf_counter()
        elif time.perf_counter() - changed >= quiet:
            break
    return last


def time_batches(iterable, skip: int, n: int, batch: int = BATCH) -> tuple[float, float]:
    """(images/s wall, images per worker-CPU-second) over batches [skip, skip + n)."""
    it = iter(iterable)
    for _ in range(skip):
        next(it)
    cpu0 = settled_cpu()
    t0 = time.perf_counter()
    got = 0
    for _ in range(n):
        images = next(it)
        images = images["image"] if isinstance(images, dict) else images[0]
        got += len(images)
    dt = time.perf_counter() - t0
    cpu1 = settled_cpu()
    cpu = sum(cpu1[p] - cpu0[p] for p in cpu1 if p in cpu0)
    del it
    gc.collect()
    return got / dt, got / cpu if cpu > 0 else float("nan")


def vlp_rate(spec, transform, tokenizer, skip, n, output="region", buffer=1000, seed=0):
    from vlp.config.keys import DataConfig
    from vlp.data.stream import make_loader

    data = DataConfig(train_shards=spec, batch_per_device=BATCH, num_workers=1, mode="split", shuffle_buffer=buffer)
    loader = make_loader(data, transform=transform, tokenize=tokenizer, seed=seed, image_output=output)
    if loader.num_batches < skip + n:
        raise ValueError(f"vlp: {loader.num_batches} batches per epoch < skip + n = {skip + n}")
    return time_batches(loader, skip, n)


def open_clip_rate(spec, transform, tokenizer, skip, n, num_samples, buffer=1000, seed=0):
    import open_clip_train.data as ocd

    ocd._SAMPLE_SHUFFLE_INITIAL = min(ocd._SAMPLE_SHUFFLE_INITIAL, buffer)
    args = Namespace(train_data=spec, val_data=None, dataset_resampled=False,
                     train_num_samples=num_samples, train_data_upsampling_factors=None,
                     seed=seed, batch_size=BATCH, world_size=1, workers=1)
    data = ocd.get_wds_dataset(args, transform, is_train=True, epoch=0, tokenizer=tokenizer)
    rate = time_batches(data.dataloader, skip, n)
    del data
    gc.collect()
    return rate


def jpeg_blobs(spec: str, limit: int) -> list[bytes]:
    from vlp.data.shard_list import expand_sources
    from vlp.data.tars import read_shard

    blobs = []
    for path in [p for src in expand_sources(spec) for p in src]:
        for _, _, members in read_shard(path, 0, None, Counter()):
            blobs += [members[e] for e in ("jpg", "jpeg") if e in members]
        if len(blobs) >= limit:
            break
    return blobs[:limit]


def decode_only(blobs: list[bytes], transform) -> dict[str, float]:
    """Images per CPU-second of decoding alone, one thread, the same JPEGs: the worker's decode
    (CropFirst.decode: header, box, DCT-scaled decode) and PIL's full decode."""
    import io

    from PIL import Image

    from vlp.data.decode import CropFirst

    crop_first = CropFirst.of(transform)
    crop_first.use_seed(0)  # boxes as a worker draws them
    out = {}
    for name, fn in (("decode_dct", crop_first.decode),
                     ("decode_full", lambda b: Image.open(io.BytesIO(b)).convert("RGB"))):
        t0 = time.process_time()
        for b in blobs:
            fn(b)
        out[name] = len(blobs) / (time.process_time() - t0)
    return out


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--samples", type=int, default=2000, help="synthetic JPEG pairs in the shards")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--skip", type=int, default=3, help="batches before timing starts")
    ap.add_argument("--buffer", type=int, default=1000, help="sample shuffle buffer (both)")
    ap.add_argument("--cache", default=str(REPO / ".cache" / "bench"))
    args = ap.parse_args(argv)
    if args.quick:
        args.samples, args.rounds, args.skip, args.buffer = 256, 1, 1, 32
    pin_threads()
    import open_clip

    header(f"data loading: images/s of one worker, {args.samples} x 512 px JPEG -> 224, batch {BATCH}")
    t0 = time.time()
    spec = jpeg_shards(args.cache, args.samples, per_shard=max(32, args.samples // 8), workers=os.cpu_count() or 1)
    print(f"# shards {spec} ready in {time.time() - t0:.0f} s", flush=True)
    transform = open_clip.image_transform(224, is_train=True)
    tokenizer = open_clip.get_tokenizer("ViT-B-32")
    n = args.samples // BATCH - args.skip - 1  # batches timed per run (inside one epoch)

    per_cpu: dict[str, list[float]] = {name: [] for name in SYSTEMS}

    def keep(name, fn):
        def f():
            wall, cpu = fn()
            per_cpu[name].append(cpu)
            print(f"  {name:12s} {wall:7.1f} img/s wall  {cpu:7.1f} img per worker CPU-s", flush=True)
            return wall
        return f

    fns = {
        "vlp": keep("vlp", lambda: vlp_rate(spec, transform, tokenizer, args.skip, n, buffer=args.buffer)),
        "vlp_uint8": keep("vlp_uint8", lambda: vlp_rate(
            spec, transform, tokenizer, args.skip, n, output="uint8", buffer=args.buffer)),
        "vlp_float": keep("vlp_float", lambda: vlp_rate(
            spec, transform, tokenizer, args.skip, n, output="float", buffer=args.buffer)),
        "open_clip": keep("open_clip", lambda: open_clip_rate(
            spec, transform, tokenizer, args.skip, n, args.samples, buffer=args.buffer)),
    }
    from vlp.data.decode import image_decoder

    print("# decoders: " + ", ".join(f"{name} {image_decoder(transform, None, out).output}" for name, out in
                                     (("vlp", "region"), ("vlp_uint8", "uint8"), ("vlp_float", "float"))), flush=True)
    blobs = jpeg_blobs(spec, min(args.samples, 400))
    limits: dict[str, list[float]] = {"decode_dct": [], "decode_full": []}

    def vlp_then_limits(run=fns["vlp"]):  # the limit right after each vlp run: the same load
        out = run()
        for key, rate in decode_only(blobs, transform).items():
            limits[key].append(rate)
        return out

    fns["vlp"] = vlp_then_limits
    rates = alternate(fns, args.rounds)
    print("\n## per round, images/s (wall); ratio = vlp / open_clip")
    for r in range(args.rounds):
        print(f"  round {r + 1}: " + "  ".join(f"{name} {rates[name][r]:.1f}" for name in SYSTEMS)
              + f"  ratio {rates['vlp'][r] / rates['open_clip'][r]:.3f}")
    print(f"\n## images/s of one worker (wall) and images per worker-CPU-second, median [min..max] "
          f"over {args.rounds} rounds of {n} batches")
    for name, xs in rates.items():
        print(f"  {name:14s} wall {spread(xs)}   per CPU-s {spread(per_cpu[name])}")
        figure(f"data_images_per_s {name}", median(xs), "img/s")
        figure(f"data_images_per_cpu_s {name}", median(per_cpu[name]), "img/CPU-s")
    for name, xs in limits.items():
        print(f"  {name:14s} (the limit: decoding alone, one thread, after each vlp run)   per CPU-s {spread(xs)}")
        figure(f"data_images_per_cpu_s {name}", median(xs), "img/CPU-s", "decode only, the same JPEGs")
    r = paired_ratio(per_cpu["vlp"], limits["decode_dct"])
    figure("data_ratio_cpu vlp/decode_dct", median(r), "x", f"[{min(r):.3f}..{max(r):.3f}] per CPU-s, same round")
    for num in SYSTEMS[:-1]:
        r = paired_ratio(rates[num], rates["open_clip"])
        figure(f"data_ratio {num}/open_clip", median(r), "x", f"[{min(r):.3f}..{max(r):.3f}] wall")
        r = paired_ratio(per_cpu[num], per_cpu["open_clip"])
        figure(f"data_ratio_cpu {num}/open_clip", median(r), "x", f"[{min(r):.3f}..{max(r):.3f}] per worker CPU-s")


if __name__ == "__main__":
    main()
