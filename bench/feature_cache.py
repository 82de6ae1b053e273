"""LiT training with and without the locked-tower feature cache (data.feature_cache), side by side.

    OMP_NUM_THREADS=1 python bench/feature_cache.py           # 1024 pairs x 2 epochs per run (~2.5 min)
    OMP_NUM_THREADS=1 python bench/feature_cache.py --quick   # 128 pairs x 2 epochs

Model: configs/lit_openmoji.yaml's vlp-lit-lite0 (EfficientNet-Lite0 trunk at 128 px and
all-MiniLM-L6-v2, both locked; only the projections and the temperature train), its towers
made by data_pipelines/prepare_lit.py from PyPI packages into a temp folder; the first --pairs OpenMoji
training pairs at 128 px (vlp.data.sources.openmoji) as shards. One process, CPU, 0
loader workers, batch 32, InfoNCE, data.train_transform=eval in both runs (the cache needs it),
so both runs train on the same samples and give the same weights (tests/train/test_feature_cache.py).

Reported: samples/s of each run's training loop (vlp's train_time_s: steps only, no start-up),
the cache build (its own figure: once per key, then reused from the memo or the folder), the
per-epoch time of each, and the speed-up of the loop and of loop + build.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench._common import REPO, figure, header, pin_threads  # noqa: E402


def prepare(root: Path, pairs: int) -> tuple[Path, Path, str]:
    """(timm trunk file, MiniLM folder, train shard spec) under root."""
    sys.path.insert(0, str(REPO / "data_pipelines"))
    from prepare_lit import convert_efficientnet, extract_minilm

    from vlp.data.sources.openmoji import load_pairs
    from vlp.data.write import write_shards

    (root / "towers").mkdir(parents=True)
    trunk, minilm = convert_efficientnet(root / "towers"), extract_minilm(root / "towers")
    spec = write_shards(load_pairs("train", image_size=128)[:pairs], root / "train", prefix="train",
                        samples_per_shard=256).spec
    return trunk, minilm, spec


BUILDS: list[float] = []  # seconds of each cache build (vlp.train.feature_cache.build_training_tensors)


def timed_builds() -> None:
    from vlp.train import feature_cache as fc

    build = fc.build_training_tensors

    def timed(*args, **kwargs):
        t0 = time.perf_counter()
        out = build(*args, **kwargs)
        BUILDS.append(time.perf_counter() - t0)
        return out

    fc.build_training_tensors = timed


def run(trunk: Path, minilm: Path, spec: str, out: Path, samples: int, cached: bool) -> tuple[float, float]:
    """(seconds of the training loop, seconds of the Trainer's start-up)."""
    from vlp.experiment import load_config
    from vlp.train.loop import Trainer

    cfg = load_config(REPO / "configs" / "lit_openmoji.yaml", [
        f"model.image_pretrained={trunk}", f"model.hf_text_dir={minilm}", f"data.train_shards={spec}",
        "data.train_transform=eval", f"train.samples={samples}", f"train.output_dir={out}",
        "train.log_every=1000", "eval.suite=null", "data.eval_shards=null", "data.shuffle_buffer=500",
        *(["data.feature_cache=memory"] if cached else [])])
    t0 = time.perf_counter()
    trainer = Trainer(cfg)
    startup = time.perf_counter() - t0
    result = trainer.train()
    return result["train_time_s"], startup


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--pairs", type=int, default=1024, help="training pairs (one epoch)")
    ap.add_argument("--epochs", type=int, default=2)
    ap.add_argument("--quick", action="store_true", help="128 pairs")
    args = ap.parse_args(argv)
    pairs = 128 if args.quick else args.pairs
    pin_threads()
    timed_builds()
    header(f"feature cache: LiT vlp-lit-lite0, {pairs} pairs x {args.epochs} epochs, batch 32, 1 process, CPU")
    with tempfile.TemporaryDirectory(prefix="vlp-bench-fc-") as tmp:
        root = Path(tmp)
        trunk, minilm, spec = prepare(root, pairs)
        samples = pairs * args.epochs
        plain_s, _ = run(trunk, minilm, spec, root / "plain", samples, cached=False)
        cached_s, _ = run(trunk, minilm, spec, root / "cached", samples, cached=True)
    build_s = sum(BUILDS)
    figure("feature_cache_samples_per_s uncached", samples / plain_s, "samples/s")
    figure("feature_cache_samples_per_s cached", samples / cached_s, "samples/s", "(cache built before)")
    figure("feature_cache_build_s", build_s, "s", f"({pairs} samples, {pairs / max(build_s, 1e-9):.1f} samples/s)")
    figure("feature_cache_epoch_s uncached", plain_s / args.epochs, "s")
    figure("feature_cache_epoch_s cached", cached_s / args.epochs, "s")
    figure("feature_cache_speedup loop", plain_s / cached_s, "x")
    figure("feature_cache_speedup loop+build", plain_s / (cached_s + build_s), "x",
           f"(one run of {args.epochs} epochs; later runs reuse the cache)")


if __name__ == "__main__":
    main()
