"""Raw (image, caption) pairs -> webdataset ``.tar`` shards + ``sizes.json``.

Each sample becomes three tar members: ``{key}.png|jpg`` (image), ``{key}.txt`` (UTF-8
caption) and ``{key}.json`` (meta). Shards are written under temporary names and renamed
together at the end, so a shard under its final name is never half-written and a failed or
empty run leaves the folder as it was; ``sizes.json`` ({shard file name: sample count}) is
rewritten the same way. Existing shards of the prefix are only replaced with ``overwrite``.
Bad rows (unreadable image, empty caption, duplicate key, a FIFO / device / oversized file) are
skipped and counted in the returned summary; a run that writes no sample is an error.

Usage::

    summary = write_shards(load_pairs("train"), "data/openmoji/train", samples_per_shard=500)
    summary.spec   # '/abs/data/openmoji/train/shard-{000000..000003}.tar' -> stream.make_loader
"""

from __future__ import annotations

import dataclasses
import errno
import io
import json
import os
import re
import tarfile
from collections import Counter
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

from .encode import EncodedSample, encode_pair
from .sources.files import iter_source
from vlp.util import atomic_write

TEMP_PATTERN = r"\.(.+\.tar|sizes\.json)\.tmp-(\d+)"  # temp names of ShardWriter (last group: PID)


class ShardError(ValueError):
    """Shards cannot be written as asked (existing shards, nothing valid, disk full); one line."""
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
    notes: list[str] = dataclasses.field(default_factory=list)

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

    def __str__(self) -> str:
        skipped = ", ".join(f"{k}={v}" for k, v in sorted(self.skipped.items())) or "none"
        spec = self.spec if self.sizes else "(no shards)"
        return "\n".join([f"wrote {self.num_samples} samples in {len(self.sizes)} shards: {spec}",
                          f"skipped: {skipped}", *self.notes])


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


class ShardWriter:
    """Writes numbered tar shards under temp names (``.{prefix}-{i:06d}.tar.tmp-PID``); ``close``
    renames them all, ``abort`` deletes them. Refuses a folder that already holds shards of the
    prefix unless ``overwrite``; removes temp files of killed writers (dead PID) on start."""

    def __init__(self, out_dir: str | os.PathLike, prefix: str = "shard",
                 samples_per_shard: int = 1000, overwrite: bool = False):
        if samples_per_shard < 1:
            raise ValueError("samples_per_shard must be >= 1")
        check_prefix(prefix)
        self.out_dir = Path(out_dir).resolve()
        self.out_dir.mkdir(parents=True, exist_ok=True)
        self.prefix, self.per_shard = prefix, samples_per_shard
        self.pattern = re.compile(rf"{re.escape(prefix)}-\d{{6}}\.tar")
        existing = sorted(p.name for p in self.out_dir.iterdir() if self.pattern.fullmatch(p.name))
        if existing and not overwrite:
            raise ShardError(f"{self.out_dir} already holds {len(existing)} shard(s) named {prefix}-NNNNNN.tar "
                             f"({existing[0]}, ...): nothing written; pass --overwrite to replace them, "
                             "or choose another output folder or --prefix")
        from vlp.util import remove_stale_temps

        removed = remove_stale_temps(self.out_dir, TEMP_PATTERN)
        self.notes = [f"removed {len(removed)} temp file(s) of killed writers ({removed[0].name}, ...)"] if removed else []
        self.sizes: dict[str, int] = {}
        self.skipped: Counter[str] = Counter()
        self._done: list[tuple[Path, str]] = []  # (temp file, final name) of finished shards
        self._tar: tarfile.TarFile | None = None
        self._keys: set[str] = set()
        self._last_key: str | None = None

    def _open_next(self) -> None:
        name = f"{self.prefix}-{len(self.sizes):06d}.tar"
        self._tmp = self.out_dir / f".{name}.tmp-{os.getpid()}"  # unique: concurrent writers never collide
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
        if self._count:
            self._done.append((self._tmp, self._name))
            self.sizes[self._name] = self._count
        else:  # every sample of it was a duplicate key
            self._tmp.unlink(missing_ok=True)

    def close(self) -> ShardSummary:
        """Rename the finished shards to their names, drop other shards of this prefix (only
        there with overwrite), write sizes.json. No sample at all: abort, ShardError."""
        self._close_current()
        if not self.sizes:
            self.abort()
            skipped = ", ".join(f"{k}={v}" for k, v in sorted(self.skipped.items())) or "the source has no rows"
            raise ShardError(f"no valid samples, nothing written ({skipped}); {self.out_dir} is unchanged")
        for tmp, name in self._done:
            os.replace(tmp, self.out_dir / name)
        self._done = []
        for path in self.out_dir.iterdir():
            if self.pattern.fullmatch(path.name) and path.name not in self.sizes:
                path.unlink()
        sizes_path = self.out_dir / "sizes.json"
        sizes = json.loads(sizes_path.read_text()) if sizes_path.is_file() else {}
        sizes = {k: v for k, v in sizes.items() if not self.pattern.fullmatch(k)}
        sizes.update(self.sizes)
        atomic_write(sizes_path, json.dumps(dict(sorted(sizes.items())), indent=1))
        return ShardSummary(str(self.out_dir), dict(self.sizes), dict(self.skipped), list(self.notes))

    def abort(self) -> None:
        """Delete every temp file of this writer: the folder is left as it was."""
        if self._tar is not None:
            tar, self._tar = self._tar, None
            self._done.append((self._tmp, self._name))
            for close in (tar.close, tar.fileobj.close):  # tar.close writes end blocks: fails again on a full disk
                try:
                    close()
                except OSError:
                    pass
        for tmp, _ in self._done:
            tmp.unlink(missing_ok=True)
        self._done = []


def check_prefix(prefix: str) -> str:
    """A shard name prefix is one plain file-name part ('train', 'cc3m.v2'), never a path."""
    if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._-]*", prefix or ""):
        raise ShardError(f"--prefix {prefix!r} must be a plain name: letters, digits, '.', '_' or '-', "
                         "starting with a letter or digit (put folders in the output path)")
    return prefix


def check_options(samples_per_shard: int, jpeg_quality: int | None, resize_longest: int | None,
                  workers: int) -> None:
    """Refuse option values that would write wrong shards silently (1 px images, ...)."""
    problems = [(samples_per_shard < 1, f"--samples-per-shard must be >= 1, got {samples_per_shard}"),
                (jpeg_quality is not None and not 1 <= jpeg_quality <= 100,
                 f"--jpeg-quality must be in [1, 100], got {jpeg_quality}"),
                (resize_longest is not None and resize_longest < 1, f"--resize-longest must be >= 1, got {resize_longest}"),
                (workers < 0, f"--workers must be >= 0, got {workers}")]
    for bad, message in problems:
        if bad:
            raise ShardError(message)


_WRITE_ERRNOS = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG, errno.EROFS, errno.EACCES, errno.EIO)


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
    overwrite: bool = False,
) -> ShardSummary:
    """Write pair-likes (see ``encode_pair``) as ``out_dir/{prefix}-{i:06d}.tar``.

    image_ext:      None keeps each image's format; 'png' or 'jpg' converts where needed.
    jpeg_quality:   re-encode JPEG output at this quality (None: pass JPEG bytes through;
                    95 when another format is converted to JPEG).
    resize_longest: downscale images whose longest side is larger (aspect kept).
    workers:        >1 validates/encodes in that many processes (order is kept).
    progress:       show a tqdm bar.
    overwrite:      replace existing ``{prefix}-*.tar`` shards of ``out_dir`` (else ShardError).
    Shard contents depend only on the input order, never on ``workers``. Any failure (disk full,
    Ctrl-C, no valid sample) leaves ``out_dir`` as it was.
    """
    check_options(samples_per_shard, jpeg_quality, resize_longest, workers)
    writer = ShardWriter(out_dir, prefix, samples_per_shard, overwrite=overwrite)
    try:
        for result in _encoded(pairs, image_ext, jpeg_quality, resize_longest, workers,
                               progress):
            if isinstance(result, str):
                writer.skipped[result] += 1
            else:
                writer.write(result)
        return writer.close()
    except OSError as e:
        writer.abort()
        if e.errno in _WRITE_ERRNOS:
            raise ShardError(f"cannot write shards to {writer.out_dir}: {e.strerror}; "
                             "nothing written, the folder is unchanged") from None
        raise
    except BaseException:
        writer.abort()
        raise


def _encode_star(args: tuple) -> EncodedSample | str:
    return encode_pair(*args)


def _encoded(pairs, image_ext, jpeg_quality, resize_longest, workers, progress
             ) -> Iterator[EncodedSample | str]:
    jobs = ((p, image_ext, jpeg_quality, resize_longest) for p in pairs)
    if progress:
        from tqdm import tqdm

        total = len(pairs) if hasattr(pairs, "__len__") else None
        jobs = iter(tqdm(jobs, total=total, unit="img", desc="shards"))
    if workers and workers > 1:
        import multiprocessing as mp

        with mp.get_context("spawn").Pool(workers) as pool:
            yield from pool.imap(_encode_star, jobs, chunksize=64)
    else:
        yield from map(_encode_star, jobs)


# ----------------------------------------------------------------------------- sources


def shards_from_source(
    source: str,
    out_dir: str | os.PathLike,
    *,
    samples_per_shard: int = 1000,
    image_ext: str | None = None,
    jpeg_quality: int | None = None,
    resize_longest: int | None = None,
    workers: int = 0,
    split: str = "all",
    prefix: str = "shard",
    image_column: str | None = None,
    caption_column: str | None = None,
    separator: str | None = None,
    progress: bool = True,
    overwrite: bool = False,
) -> ShardSummary:
    """Write shards from any supported source; the type is detected from ``source``:

    - ``openmoji`` (``split``: train | eval | all) or ``synthetic:N[:SIZE]``;
    - ``*.csv`` / ``*.tsv``: one row per pair, image path column (open_clip's ``filepath``,
      relative to the file's folder or absolute) and caption column (``title``); the
      separator is a tab unless ``separator`` says otherwise or the header has no tab;
    - ``*.parquet`` file, or a folder of them: image column with bytes, an HF Image struct
      ({bytes, path}) or a path; caption column;
    - a folder saved by HF ``datasets.save_to_disk`` (``split`` picks train / eval=validation
      or test / all);
    - an HF imagefolder (``metadata.jsonl`` / ``metadata.csv`` with ``file_name`` + caption);
    - any other folder: images with a sidecar ``.txt`` of the same stem, at any depth.

    Columns are found by name (sources/files.py: ``CAPTION_COLUMNS``, ``IMAGE_COLUMNS``, ``PATH_COLUMNS``)
    unless ``image_column`` / ``caption_column`` are given. Other options as in
    ``write_shards``. Returns the ShardSummary (str() is a two-line report).
    """
    check_prefix(prefix)
    check_options(samples_per_shard, jpeg_quality, resize_longest, workers)
    rows = iter_source(source, split=split, image_column=image_column,
                       caption_column=caption_column, separator=separator)
    return write_shards(rows, out_dir, prefix=prefix, samples_per_shard=samples_per_shard,
                        image_ext=image_ext, jpeg_quality=jpeg_quality,
                        resize_longest=resize_longest, workers=workers, progress=progress,
                        overwrite=overwrite)
