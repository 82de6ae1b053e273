"""Helpers for eval tests (a uniquely named module: `conftest` names collide across test dirs)."""
import io
import os

import numpy as np
from PIL import Image
from vlp_testing import write_tar as _write_tar


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
    return str(_write_tar(path, samples))
