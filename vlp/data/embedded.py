"""The embedded default data set as shards: OpenMoji pairs (vlp.data.sources.openmoji)
written once per split under .cache/shards/ (vlp.data.write). Sources produce pairs;
this module is the one place that turns the embedded ones into shards."""

from __future__ import annotations

import os
from pathlib import Path

from vlp.data.sources.openmoji import load_pairs
from vlp.data.write import shard_spec, write_shards

SHARD_CACHE = Path(".cache") / "shards" / "openmoji"  # relative: under the working directory


def prepare_shards(root: str | os.PathLike = SHARD_CACHE, splits: tuple[str, ...] = ("train", "eval"),
                   image_size: int = 64) -> dict[str, str]:
    """Render the pairs (cached) at ``image_size`` px and write the shards of ``splits`` ('train'
    and 'eval', or the study's 'fit', 'val' and 'test') under ``root`` once (a folder with its
    sizes.json is reused); return {split: shard spec}. Used by `vlp demo`, `vlp compare` on the
    embedded data, the benchmarks and the tests."""
    specs = {}
    for split in splits:
        out = Path(root) / split
        if not (out / "sizes.json").is_file():
            write_shards(load_pairs(split, image_size=image_size), out, prefix=split, samples_per_shard=500,
                         overwrite=True)
        specs[split] = shard_spec(out, prefix=split)
    return specs
