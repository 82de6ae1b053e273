"""Helpers shared by the data_pipelines tests (a unique module name: tests/ has no packages)."""

from __future__ import annotations

import io
import json
from pathlib import Path

import numpy as np
import torch
from vlp_testing import write_tar as _write_tar


def to_tensor(image) -> torch.Tensor:
    """PIL RGB -> float [3,H,W] in [0,1] (module-level so workers can pickle it)."""
    return torch.from_numpy(np.asarray(image, dtype=np.float32) / 255.0).permute(2, 0, 1)


def tokenize(captions: list[str], length: int = 8) -> torch.Tensor:
    """Toy tokenizer: the first ``length`` byte values, zero-padded -> LongTensor [b, length]."""
    out = torch.zeros(len(captions), length, dtype=torch.long)
    for i, caption in enumerate(captions):
        data = list(caption.encode("utf-8"))[:length]
        out[i, : len(data)] = torch.tensor(data, dtype=torch.long)
    return out


def write_tar(path: Path, samples: list[tuple[str, dict[str, bytes]]]) -> Path:
    """A raw tar with the given {key: {ext: bytes}} members, in order."""
    return _write_tar(path, samples)


def write_sizes(directory: Path, sizes: dict[str, int]) -> None:
    (directory / "sizes.json").write_text(json.dumps(sizes))


def png_bytes(value: int, size: int = 8) -> bytes:
    from PIL import Image

    buf = io.BytesIO()
    Image.new("RGB", (size, size), (value % 256, 0, 0)).save(buf, format="PNG")
    return buf.getvalue()


def jpeg_bytes(value: int, size: int = 16) -> bytes:
    from PIL import Image

    buf = io.BytesIO()
    Image.new("RGB", (size, size), (value % 256, 40, 90)).save(buf, format="JPEG")
    return buf.getvalue()
