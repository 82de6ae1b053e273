"""The render cache shared by the packaged sources (openclipart, material_icons): each renders its
pairs once per image size into ``<cache>/<name>/<size>px-<version tag>/`` (PNG files plus
``index.json``), git-ignored, and reads them back per split (vlp.data.sources.splits).
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

from . import Pair
from .splits import SPLITS, in_split, split_of

BACKGROUND = (255, 255, 255)


class MissingPackage(FileNotFoundError):
    """A packaged source whose Debian package is not installed (one `vlp: error:` line)."""


def require(path: Path, name: str, packages: tuple[str, ...]) -> Path:
    """``path`` if it exists, else MissingPackage naming the apt-get line that installs it."""
    if not path.exists():
        raise MissingPackage(f"{name}: {path} not found; install it with "
                             f"`apt-get install -y {' '.join(packages)}` (Debian/Ubuntu)")
    return path


def default_cache_dir(name: str) -> Path:
    """$VLP_CACHE/<name> if set, else <repo>/.cache/<name> (git-ignored)."""
    root = os.environ.get("VLP_CACHE")
    if root:
        return Path(root) / name
    return Path(__file__).resolve().parents[3] / ".cache" / name


def cache_path(name: str, versions: str, image_size: int, cache_dir: str | os.PathLike | None) -> Path:
    root = Path(cache_dir) if cache_dir is not None else default_cache_dir(name)
    return root / f"{image_size}px-{hashlib.sha1(versions.encode()).hexdigest()[:8]}"


def build_once(target: Path, build: Callable[[Path], None]) -> Path:
    """Run ``build(tmp)`` into a temporary sibling of ``target`` and rename it into place, unless
    ``target/index.json`` exists; concurrent callers race safely (the loser discards its copy)."""
    if (target / "index.json").is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".render-", dir=target.parent))
    try:
        build(tmp)
        try:
            os.rename(tmp, target)
        except OSError:
            if not (target / "index.json").is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def square(image, size: int):
    """An RGB ``size`` x ``size`` image: ``image`` (any mode; transparency over white) scaled to fit,
    aspect kept, centred on white. Scaled with premultiplied alpha (no dark fringes), then flattened."""
    from PIL import Image  # heavy: imported when rendering only

    scale = size / max(image.size)
    w, h = max(1, round(image.width * scale)), max(1, round(image.height * scale))
    small = image.convert("RGBA").convert("RGBa").resize((w, h), Image.LANCZOS, reducing_gap=2.0)
    small = small.convert("RGBA")
    out = Image.new("RGBA", (size, size), BACKGROUND + (255,))
    out.alpha_composite(small, ((size - w) // 2, (size - h) // 2))
    return out.convert("RGB")


def png_bytes(image) -> bytes:
    buf = io.BytesIO()
    image.save(buf, format="PNG", optimize=False)
    return buf.getvalue()


def write_index(directory: Path, versions: str, image_size: int, rows: list[dict],
                skipped: dict[str, int]) -> None:
    """``index.json``: the kept rows (key, name, caption, meta; 'split' added) and the skip counts."""
    for row in rows:
        row["split"] = split_of(row["name"])
    payload = {"versions": versions, "image_size": image_size, "pairs": rows,
               "skipped": dict(sorted(skipped.items()))}
    (directory / "index.json").write_text(json.dumps(payload, ensure_ascii=False, indent=0))


def read_index(directory: Path) -> dict:
    return json.loads((directory / "index.json").read_text())


def load_split(directory: Path, split: str) -> list[Pair]:
    """The cached pairs of ``split`` ('train' | 'eval' | 'all' | 'fit' | 'val' | 'test') in index
    order; Pair.meta is the row less key and caption."""
    if split not in SPLITS:
        raise ValueError(f"split must be one of {', '.join(SPLITS)}, got {split!r}")
    pairs = []
    for row in read_index(directory)["pairs"]:
        if in_split(row["name"], row["split"], split):
            meta = {k: v for k, v in row.items() if k not in ("key", "caption")}
            image = (directory / "images" / f"{row['key']}.png").read_bytes()
            pairs.append(Pair(key=row["key"], image=image, caption=row["caption"], meta=meta))
    return pairs
