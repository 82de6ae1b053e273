"""Raw (image, caption) pairs -> webdataset ``.tar`` shards + ``sizes.json``.

Each sample becomes three tar members: ``{key}.png|jpg`` (image), ``{key}.txt`` (UTF-8
caption) and ``{key}.json`` (meta). Shards are written under a temporary name and renamed
when complete, so a shard under its final name is never half-written; ``sizes.json``
({shard file name: sample count}) is rewritten the same way at the end. Bad rows (unreadable
image, empty caption, duplicate key) are skipped and counted in the returned summary.

Usage::

    summary = write_shards(load_pairs("train"), "data/openmoji/train", samples_per_shard=500)
    summary.spec   # '/abs/data/openmoji/train/shard-{000000..000003}.tar' -> stream.make_loader
"""

from __future__ import annotations

import dataclasses
import io
import json
import os
import re
import tarfile
from collections import Counter
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

from .sources import check_key

IMAGE_EXTS = ("jpg", "jpeg", "png", "webp", "bmp", "gif", "tif", "tiff")
_PIL_FORMAT_EXT = {"JPEG": "jpg", "PNG": "png", "WEBP": "webp", "BMP": "bmp", "GIF": "gif",
                   "TIFF": "tif"}


@dataclasses.dataclass
class ShardSummary:
    """What ``write_shards`` produced.

    out_dir: absolute output directory.
    sizes:   {shard file name: samples}, in shard order (also in ``out_dir/sizes.json``).
    skipped: {kind: count} of rows left out ('corrupt_image', 'missing_caption', ...).
    """

    out_dir: str
    sizes: dict[str, int]
    skipped: dict[str, int]

    @property
    def shards(self) -> list[str]:
        return [os.path.join(self.out_dir, name) for name in self.sizes]

    @property
    def num_samples(self) -> int:
        return sum(self.sizes.values())

    @property
    def spec(self) -> str:
        """Brace-expansion spec of the written shards, for ``stream.make_loader``."""
        return spec_for(self.shards)


@dataclasses.dataclass
class EncodedSample:
    key: str
    image_ext: str
    image: bytes
    caption: str
    meta: dict[str, Any]


def spec_for(paths: list[str]) -> str:
    """'/d/shard-{000000..000003}.tar' for consecutive numbered shards, else '::'-joined."""
    if not paths:
        raise ValueError("no shards")
    matches = [re.fullmatch(r"(.*-)(\d+)(\.tar)", p) for p in paths]
    if all(matches):
        heads = {(m.group(1), m.group(3), len(m.group(2))) for m in matches}
        numbers = [int(m.group(2)) for m in matches]
        if len(heads) == 1 and numbers == list(range(numbers[0], numbers[0] + len(numbers))):
            head, tail, width = heads.pop()
            if len(paths) == 1:
                return paths[0]
            return f"{head}{{{numbers[0]:0{width}d}..{numbers[-1]:0{width}d}}}{tail}"
    return "::".join(paths)


def shard_spec(out_dir: str | os.PathLike, prefix: str = "shard") -> str:
    """The spec of the shards listed in ``out_dir/sizes.json`` whose names start with prefix."""
    out = Path(out_dir).resolve()
    sizes = json.loads((out / "sizes.json").read_text())
    names = sorted(n for n in sizes if n.startswith(f"{prefix}-"))
    if not names:
        raise FileNotFoundError(f"no '{prefix}-*.tar' shards listed in {out / 'sizes.json'}")
    return spec_for([str(out / n) for n in names])


def _field(obj: Any, *names: str, default: Any = None) -> Any:
    for name in names:
        if isinstance(obj, dict) and name in obj:
            return obj[name]
        if not isinstance(obj, dict) and hasattr(obj, name):
            return getattr(obj, name)
    return default


def encode_pair(
    pair: Any,
    image_ext: str | None = None,
    jpeg_quality: int | None = None,
    resize_longest: int | None = None,
) -> EncodedSample | str:
    """Validate and (re-)encode one pair-like (attributes or dict keys ``key``,
    ``image``/``image_png`` bytes or ``image_path``, ``caption``, ``meta``).

    Returns an EncodedSample, or the skip kind as a string. The image bytes pass through
    unchanged when no resize is asked, the format already matches ``image_ext`` (None: keep
    any format) and no ``jpeg_quality`` re-encode is asked for a JPEG.
    """
    from PIL import Image

    key = _field(pair, "key")
    caption = _field(pair, "caption", default="")
    meta = dict(_field(pair, "meta", default=None) or {})
    if not isinstance(caption, str) or not caption.strip():
        return "missing_caption"
    try:
        raw = _field(pair, "image", "image_png")
        if raw is None:
            raw = Path(_field(pair, "image_path")).read_bytes()
        with Image.open(io.BytesIO(raw)) as image:
            src_ext = _PIL_FORMAT_EXT.get(image.format or "", None)
            image.load()
            want = (image_ext or src_ext or "png").lower().replace("jpeg", "jpg")
            too_big = resize_longest is not None and max(image.size) > resize_longest
            requality = want == "jpg" and jpeg_quality is not None
            if src_ext == want and not too_big and not requality:
                return EncodedSample(check_key(key), want, raw, caption.strip(), meta)
            out = _reencode(image, want, jpeg_quality, resize_longest if too_big else None)
    except (OSError, ValueError, SyntaxError, Image.DecompressionBombError, TypeError):
        return "corrupt_image"
    return EncodedSample(check_key(key), want, out, caption.strip(), meta)


def _reencode(image, ext: str, jpeg_quality: int | None, resize_longest: int | None) -> bytes:
    from PIL import Image

    if resize_longest is not None:
        scale = resize_longest / max(image.size)
        size = (max(1, round(image.width * scale)), max(1, round(image.height * scale)))
        image = image.resize(size, Image.Resampling.BICUBIC, reducing_gap=3.0)
    if ext == "jpg":
        image = image.convert("RGB")
    elif image.mode not in ("RGB", "RGBA", "L", "LA"):
        image = image.convert("RGBA" if "A" in image.getbands() else "RGB")
    buf = io.BytesIO()
    if ext == "jpg":
        image.save(buf, format="JPEG", quality=jpeg_quality or 95)
    else:
        image.save(buf, format=ext.upper().replace("TIF", "TIFF"))
    return buf.getvalue()


class ShardWriter:
    """Writes numbered tar shards atomically: ``{prefix}-{i:06d}.tar.tmp`` -> final name."""

    def __init__(self, out_dir: str | os.PathLike, prefix: str = "shard",
                 samples_per_shard: int = 1000):
        if samples_per_shard < 1:
            raise ValueError("samples_per_shard must be >= 1")
        self.out_dir = Path(out_dir).resolve()
        self.out_dir.mkdir(parents=True, exist_ok=True)
        self.prefix, self.per_shard = prefix, samples_per_shard
        self.sizes: dict[str, int] = {}
        self.skipped: Counter[str] = Counter()
        self._tar: tarfile.TarFile | None = None
        self._keys: set[str] = set()
        self._last_key: str | None = None

    def _open_next(self) -> None:
        name = f"{self.prefix}-{len(self.sizes):06d}.tar"
        self._tmp = self.out_dir / f".{name}.tmp"
        self._name = name
        self._tar = tarfile.open(self._tmp, "w", format=tarfile.GNU_FORMAT)
        self._count = 0
        self._keys = set()

    def _add_member(self, name: str, data: bytes) -> None:
        info = tarfile.TarInfo(name)
        info.size, info.mtime, info.mode = len(data), 0, 0o644
        self._tar.addfile(info, io.BytesIO(data))

    def write(self, sample: EncodedSample) -> None:
        if self._tar is None:
            self._open_next()
        if sample.key in self._keys or sample.key == self._last_key:
            self.skipped["duplicate_key"] += 1
            return
        self._keys.add(sample.key)
        self._last_key = sample.key
        self._add_member(f"{sample.key}.{sample.image_ext}", sample.image)
        self._add_member(f"{sample.key}.txt", sample.caption.encode("utf-8"))
        meta = json.dumps(sample.meta, ensure_ascii=False, sort_keys=True, default=str)
        self._add_member(f"{sample.key}.json", meta.encode("utf-8"))
        self._count += 1
        if self._count >= self.per_shard:
            self._close_current()

    def _close_current(self) -> None:
        if self._tar is None:
            return
        self._tar.close()
        self._tar = None
        os.replace(self._tmp, self.out_dir / self._name)
        self.sizes[self._name] = self._count

    def close(self) -> ShardSummary:
        """Finish the last shard, drop stale shards of this prefix, write sizes.json."""
        self._close_current()
        pattern = re.compile(rf"{re.escape(self.prefix)}-\d{{6}}\.tar")
        for path in self.out_dir.iterdir():
            if pattern.fullmatch(path.name) and path.name not in self.sizes:
                path.unlink()
        sizes_path = self.out_dir / "sizes.json"
        sizes = json.loads(sizes_path.read_text()) if sizes_path.is_file() else {}
        sizes = {k: v for k, v in sizes.items() if not pattern.fullmatch(k)}
        sizes.update(self.sizes)
        tmp = self.out_dir / ".sizes.json.tmp"
        tmp.write_text(json.dumps(dict(sorted(sizes.items())), indent=1))
        os.replace(tmp, sizes_path)
        return ShardSummary(str(self.out_dir), dict(self.sizes), dict(self.skipped))

    def abort(self) -> None:
        if self._tar is not None:
            self._tar.close()
            self._tar = None
            self._tmp.unlink(missing_ok=True)


def write_shards(
    pairs: Iterable[Any],
    out_dir: str | os.PathLike,
    *,
    prefix: str = "shard",
    samples_per_shard: int = 1000,
    image_ext: str | None = None,
    jpeg_quality: int | None = None,
    resize_longest: int | None = None,
    workers: int = 0,
    progress: bool = False,
) -> ShardSummary:
    """Write pair-likes (see ``encode_pair``) as ``out_dir/{prefix}-{i:06d}.tar``.

    image_ext:      None keeps each image's format; 'png' or 'jpg' converts where needed.
    jpeg_quality:   re-encode JPEG output at this quality (None: pass JPEG bytes through;
                    95 when another format is converted to JPEG).
    resize_longest: downscale images whose longest side is larger (aspect kept).
    workers:        >0 validates/encodes in that many processes (order is kept).
    progress:       show a tqdm bar.
    Shard contents depend only on the input order, never on ``workers``.
    """
    writer = ShardWriter(out_dir, prefix, samples_per_shard)
    try:
        for result in _encoded(pairs, image_ext, jpeg_quality, resize_longest, workers,
                               progress):
            if isinstance(result, str):
                writer.skipped[result] += 1
            else:
                writer.write(result)
    except BaseException:
        writer.abort()
        raise
    return writer.close()


def _encode_star(args: tuple) -> EncodedSample | str:
    return encode_pair(*args)


def _encoded(pairs, image_ext, jpeg_quality, resize_longest, workers, progress
             ) -> Iterator[EncodedSample | str]:
    jobs = ((p, image_ext, jpeg_quality, resize_longest) for p in pairs)
    if progress:
        from tqdm import tqdm

        total = len(pairs) if hasattr(pairs, "__len__") else None
        jobs = iter(tqdm(jobs, total=total, unit="img", desc="shards"))
    if workers and workers > 0:
        import multiprocessing as mp

        with mp.get_context("spawn").Pool(workers) as pool:
            yield from pool.imap(_encode_star, jobs, chunksize=64)
    else:
        yield from map(_encode_star, jobs)
