"""Shared fixtures for eval tests: a tiny open_clip model built from a config file (no weights,
no downloads) and small image folders / shards written on the fly."""
import io
import json
import os
import tarfile

import numpy as np
import pytest
import torch
from PIL import Image

TINY_CFG = {
    "embed_dim": 64,
    "vision_cfg": {"image_size": 32, "layers": 2, "width": 64, "head_width": 32, "patch_size": 8},
    "text_cfg": {"context_length": 32, "vocab_size": 49408, "width": 64, "heads": 2, "layers": 2},
}


@pytest.fixture(scope="session")
def tiny_clip(tmp_path_factory):
    """(model, tokenizer, transform) of a 2-layer ViT/text tower CLIP, random init, eval mode."""
    import open_clip

    cfg_dir = tmp_path_factory.mktemp("open_clip_cfg")
    (cfg_dir / "vlp-eval-tiny.json").write_text(json.dumps(TINY_CFG))
    open_clip.add_model_config(cfg_dir)
    torch.manual_seed(0)
    model = open_clip.create_model("vlp-eval-tiny", pretrained=None).eval()
    tokenizer = open_clip.get_tokenizer("vlp-eval-tiny")
    transform = open_clip.image_transform(32, is_train=False)
    return model, tokenizer, transform


def random_png(rng: np.random.Generator, size=(40, 36)) -> bytes:
    arr = rng.integers(0, 256, size=(size[1], size[0], 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(arr).save(buf, format="PNG")
    return buf.getvalue()


def write_class_folders(root, folders, per_class=2, seed=0):
    rng = np.random.default_rng(seed)
    for d in folders:
        os.makedirs(os.path.join(root, d), exist_ok=True)
        for i in range(per_class):
            with open(os.path.join(root, d, f"img{i}.png"), "wb") as f:
                f.write(random_png(rng))
    return root


def write_tar(path, samples):
    """samples: list of (key, {ext: bytes})."""
    with tarfile.open(path, "w") as tar:
        for key, members in samples:
            for ext, data in members.items():
                info = tarfile.TarInfo(f"{key}.{ext}")
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))
    return str(path)
