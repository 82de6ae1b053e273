"""Images/s of the loader streaming shards over HTTP (127.0.0.1) vs reading the same local files.

    OMP_NUM_THREADS=1 python bench/remote_loading.py           # 2000 x 512 px JPEGs, 5 rounds (~3 min)
    OMP_NUM_THREADS=1 python bench/remote_loading.py --quick   # 128 JPEGs, 1 round (< 20 s)

Same synthetic JPEG shards as bench/data_loading.py (512 px, quality 90, cached under
.cache/bench/), same transform (open_clip.image_transform(224, is_train=True)), ViT-B-32's
tokenizer, batch 32, shuffled split mode, ``--workers`` DataLoader workers (default 1: the rate
per worker, the figure that matters when CPU cores limit a GPU).

Systems, alternated each round (rotating which goes first):
  local  make_loader('/cache/.../shard-{000000..000007}.tar')
  http   make_loader('http://127.0.0.1:PORT/shard-{000000..000007}.tar'): the same shards from
         python's ThreadingHTTPServer in a separate process (sizes.json fetched over HTTP;
         each shard one streamed GET through fsspec, vlp/data/shard_io.py)

Each run times batches [skip, skip + n) (worker start and the shuffle-buffer fill excluded).
Also: images per worker-CPU-second (the client-side cost of streaming, insensitive to the
server's CPU use on the same machine). Ratios http/local are per round, median over rounds;
the goal is >= 0.9.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench._common import (  # noqa: E402
    PYTHON, REPO, alternate, bench_env, figure, header, jpeg_shards, median, paired_ratio,
    pin_threads, spread,
)
from bench.data_loading import BATCH, time_batches  # noqa: E402


class HttpServer:
    """``python -m http.server`` on 127.0.0.1 (a free port) serving ``root``, in its own process."""

    def __init__(self, root: str | Path):
        self.proc = subprocess.Popen(
            [PYTHON, "-u", "-m", "http.server", "0", "--bind", "127.0.0.1", "--directory", str(root)],
            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=bench_env())
        line = self.proc.stdout.readline()  # "Serving HTTP on 127.0.0.1 port 41234 (http://...) ..."
        match = re.search(r"port (\d+)", line)
        if not match:
            self.close()
            raise RuntimeError(f"http.server did not start: {line!r}")
        self.url = f"http://127.0.0.1:{match.group(1)}"

    def close(self) -> None:
        self.proc.kill()
        self.proc.wait()


def loader_rate(spec, transform, tokenizer, skip, n, workers, buffer, seed=0):
    from vlp.config.keys import DataConfig
    from vlp.data.stream import make_loader

    data = DataConfig(train_shards=spec, batch_per_device=BATCH, num_workers=workers, mode="split",
                      shuffle_buffer=buffer)
    loader = make_loader(data, transform=transform, tokenize=tokenizer, seed=seed)
    if loader.num_batches < skip + n:
        raise ValueError(f"{loader.num_batches} batches per epoch < skip + n = {skip + n}")
    return time_batches(loader, skip, n)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--samples", type=int, default=2000, help="synthetic JPEG pairs in the shards")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--skip", type=int, default=3, help="batches before timing starts")
    ap.add_argument("--buffer", type=int, default=1000, help="sample shuffle buffer")
    ap.add_argument("--workers", type=int, default=1, help="DataLoader workers")
    ap.add_argument("--cache", default=str(REPO / ".cache" / "bench"))
    args = ap.parse_args(argv)
    if args.quick:
        args.samples, args.rounds, args.skip, args.buffer = 128, 1, 1, 32
    pin_threads()
    import open_clip

    header(f"remote loading: images/s, http://127.0.0.1 vs local files, {args.samples} x 512 px JPEG "
           f"-> 224, batch {BATCH}, {args.workers} worker(s)")
    spec = jpeg_shards(args.cache, args.samples, per_shard=max(32, args.samples // 8),
                       workers=os.cpu_count() or 1)
    root = str(Path(spec).parent)
    server = HttpServer(root)
    try:
        http_spec = server.url + "/" + Path(spec).name
        print(f"# local {spec}\n# http  {http_spec}", flush=True)
        transform = open_clip.image_transform(224, is_train=True)
        tokenizer = open_clip.get_tokenizer("ViT-B-32")
        n = args.samples // BATCH - args.skip - 1
        per_cpu: dict[str, list[float]] = {"local": [], "http": []}

        def run(name, which):
            def f():
                t0 = time.perf_counter()
                wall, cpu = loader_rate(which, transform, tokenizer, args.skip, n, args.workers, args.buffer)
                per_cpu[name].append(cpu)
                print(f"  {name:5s} {wall:7.1f} img/s  {cpu:7.1f} img/CPU-s  ({time.perf_counter() - t0:.1f} s)",
                      flush=True)
                return wall
            return f

        rates = alternate({"local": run("local", spec), "http": run("http", http_spec)}, args.rounds)
    finally:
        server.close()
    print(f"\n## images/s (wall) and images per worker-CPU-second, median [min..max] over "
          f"{args.rounds} rounds of {n} batches")
    for name, xs in rates.items():
        print(f"  {name:6s} wall {spread(xs)}   per CPU-s {spread(per_cpu[name])}")
        figure(f"remote_images_per_s {name}", median(xs), "img/s")
    r = paired_ratio(rates["http"], rates["local"])
    figure("remote_ratio http/local", median(r), "x", f"[{min(r):.3f}..{max(r):.3f}] wall (goal >= 0.9)")
    r = paired_ratio(per_cpu["http"], per_cpu["local"])
    figure("remote_ratio_cpu http/local", median(r), "x", f"[{min(r):.3f}..{max(r):.3f}] per worker CPU-s")


if __name__ == "__main__":
    main()
