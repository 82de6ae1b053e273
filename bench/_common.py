"""Small helpers shared by the benchmark scripts: medians, alternating timers, env, printing.

Every script prints its figures as lines starting with ``FIGURE`` so the smoke test (and a
reader grepping a log) finds them:

    FIGURE <name> = <value> <unit>  [extra]
"""

from __future__ import annotations

import datetime
import os
import platform
import random
import socket
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
PYTHON = sys.executable


def scratch(prefix: str) -> str:
    """A temporary folder removed when this process exits (a benchmark's run folders)."""
    import atexit
    import shutil
    import tempfile

    folder = tempfile.mkdtemp(prefix=prefix)
    atexit.register(shutil.rmtree, folder, True)
    return folder


def bench_env(**extra: str) -> dict:
    """Environment for child processes: one BLAS/OpenMP thread, repo importable, no GPU."""
    env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", PYTHONPATH=str(REPO),
               CUDA_VISIBLE_DEVICES="", TOKENIZERS_PARALLELISM="false", PYTHONUNBUFFERED="1")
    env.update(extra)
    return env


def overrides(*items: str) -> list[str]:
    """`key=value` overrides for a `vlp` command line, a later item replacing an earlier one of the
    same key (a script's extras over its base list; `vlp` refuses a key given twice)."""
    merged: dict[str, str] = {}
    for item in items:
        merged[item.split("=", 1)[0]] = item
    return list(merged.values())


def pin_threads() -> None:
    """The benchmarks measure one compute thread per process (OMP_NUM_THREADS=1)."""
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import torch

    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))


def free_port() -> int:
    """A TCP port on this machine that nothing holds now, drawn below the kernel's ephemeral range
    (/proc/sys/net/ipv4/ip_local_port_range). The kernel's own pick (bind port 0) lies inside that
    range, which every outgoing connection and every listener on port 0 (srun's I/O ports, gloo's
    pairs) draws from: such a port can be handed to someone else before the launcher binds it."""
    try:
        low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        low = 32768
    draw = random.SystemRandom()
    for _ in range(200):
        port = draw.randrange(10000, max(low, 10001))
        with socket.socket() as s:
            try:
                s.bind(("", port))
            except OSError:
                continue
            return port
    with socket.socket() as s:  # everything below the range is taken: the kernel's pick
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def median(xs) -> float:
    return float(statistics.median(xs))


def spread(xs) -> str:
    """'median [min..max] (n=..)' for a list of numbers."""
    xs = list(xs)
    return f"{median(xs):.4g} [{min(xs):.4g}..{max(xs):.4g}] (n={len(xs)})"


def alternate(fns: dict[str, Callable[[], float]], repeats: int) -> dict[str, list[float]]:
    """Call each fn once per round (A B A B ...), rotating the start so no variant always
    runs first; returns {name: [value per round]}."""
    names = list(fns)
    out: dict[str, list[float]] = {n: [] for n in names}
    for r in range(repeats):
        order = names[r % len(names):] + names[:r % len(names)]
        for name in order:
            out[name].append(fns[name]())
    return out


def paired_ratio(num: list[float], den: list[float]) -> list[float]:
    """Per-round ratios (measured side by side, so slow drift of machine load cancels)."""
    return [a / b for a, b in zip(num, den)]


def figure(name: str, value: float, unit: str = "", extra: str = "") -> None:
    print(f"FIGURE {name} = {value:.4g} {unit}".rstrip() + (f"  {extra}" if extra else ""), flush=True)


def header(title: str) -> None:
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    print(f"# {title}\n# {datetime.date.today()}  {platform.machine()} {os.cpu_count()} cores  "
          f"python {platform.python_version()}  load(1min)={load:.2f}  "
          f"OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS')}", flush=True)


def run(cmd: list[str], env: dict | None = None, cwd: str | Path | None = None,
        timeout: float = 900) -> tuple[float, str]:
    """Run a command; return (wall seconds, combined output); raise with the output tail on failure."""
    t0 = time.perf_counter()
    p = subprocess.run(cmd, env=env or bench_env(), cwd=cwd or REPO, capture_output=True, text=True,
                       timeout=timeout)
    wall = time.perf_counter() - t0
    out = p.stdout + p.stderr
    if p.returncode != 0:
        raise RuntimeError(f"command failed ({p.returncode}): {' '.join(cmd)}\n{out[-4000:]}")
    return wall, out


# ----------------------------------------------------------------------------- synthetic JPEGs
_WORDS = ("a photo of", "red", "blue", "green", "small", "large", "dog", "cat", "car", "tree",
          "house", "on the", "beach", "in a", "field", "at night", "with", "two", "people")


def synthetic_jpeg_pairs(count: int, size: int = 512, seed: int = 0, quality: int = 90, start: int = 0):
    """Pair dicts (key, image bytes, caption, meta) of smooth random colour gradients plus
    noise, JPEG-encoded at `quality`: photo-like entropy, so decode cost is realistic.
    Keys are synth_{start + i}."""
    import io
    import random

    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(seed)
    words = random.Random(seed)
    for i in range(count):
        low = rng.integers(0, 256, size=(4, 4, 3), dtype=np.uint8)
        smooth = np.asarray(Image.fromarray(low).resize((size, size), Image.Resampling.BICUBIC),
                            dtype=np.float32)
        noise = rng.standard_normal(smooth.shape, dtype=np.float32) * 10
        noisy = np.clip(smooth + noise, 0, 255).astype(np.uint8)
        buf = io.BytesIO()
        Image.fromarray(noisy).save(buf, format="JPEG", quality=quality)
        caption = " ".join(words.choice(_WORDS) for _ in range(words.randint(4, 12)))
        yield {"key": f"synth_{start + i:08d}", "image": buf.getvalue(), "caption": caption,
               "meta": {"i": start + i}}


_CHUNK = 256


def _jpeg_chunk(args: tuple) -> list[dict]:
    chunk, count, size = args
    n = min(_CHUNK, count - chunk * _CHUNK)
    return list(synthetic_jpeg_pairs(n, size, seed=chunk, start=chunk * _CHUNK))


def _parallel_pairs(count: int, size: int, workers: int):
    import multiprocessing as mp

    jobs = [(c, count, size) for c in range((count + _CHUNK - 1) // _CHUNK)]
    with mp.get_context("fork").Pool(workers) as pool:
        for pairs in pool.imap(_jpeg_chunk, jobs):
            yield from pairs


def jpeg_shards(root: str | Path, count: int, per_shard: int, size: int = 512, workers: int = 1) -> str:
    """Write (once, cached under root) `count` synthetic JPEG pairs; return the shard spec.
    Chunks of 256 pairs have their own seed, so the data do not depend on `workers`."""
    from vlp.data.write import shard_spec, write_shards

    root = Path(root) / f"jpeg{size}_n{count}_s{per_shard}"
    if not (root / "sizes.json").is_file():
        pairs = _parallel_pairs(count, size, workers) if workers > 1 else \
            (p for c in range((count + _CHUNK - 1) // _CHUNK) for p in _jpeg_chunk((c, count, size)))
        write_shards(pairs, root, prefix="shard", samples_per_shard=per_shard)
    return shard_spec(root, prefix="shard")


def rank_bytes(model, optimizer) -> tuple[int, int]:
    """(parameter bytes, optimizer-state bytes) held by this rank: the local shards under FSDP."""
    import torch

    from vlp.train.parallel import local

    def nbytes(t) -> int:
        t = local(t)
        return t.numel() * t.element_size()

    params = sum(nbytes(p) for p in model.parameters())
    state = sum(nbytes(v) for s in optimizer.state.values() for v in s.values() if torch.is_tensor(v))
    return params, state


def bench_device(cpu: bool):
    """The device a GPU benchmark runs on: CUDA, or the CPU for its smoke run (--cpu, with
    ACCELERATE_USE_CPU set); SystemExit without CUDA. Returns (device, its name for the header)."""
    import torch

    if not cpu and not torch.cuda.is_available():
        raise SystemExit("no CUDA device: run with --cpu (and --tiny) for the CPU smoke run")
    if cpu:
        os.environ["ACCELERATE_USE_CPU"] = "true"
    device = torch.device("cpu" if cpu else "cuda")
    return device, torch.cuda.get_device_name(0) if device.type == "cuda" else "cpu"
