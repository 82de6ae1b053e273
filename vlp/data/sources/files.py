"""Readers of image-text pairs on disk, for `vlp shards` (vlp.data.write.shards_from_source):
an image folder with .txt sidecars, a CSV/TSV of paths and captions (open_clip's format), parquet
files with image bytes, a Hugging Face `imagefolder` (metadata.jsonl/csv) or a dataset saved with
`save_to_disk`; and the built-in sources by name ('openmoji', 'openclipart', 'material_icons'
(vlp.data.sources.PACKAGED), 'synthetic:N').

Every reader yields pair-likes (a Pair, or a dict with key, caption or caption_path, image or
image_path, meta) in a stable order; ``vlp.data.encode.encode_pair`` reads and checks them.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

from vlp.data.sources import DEFAULT_PX, packaged_source, parse_packaged
from vlp.data.tars import IMAGE_EXTS

# column names tried in order when a table's columns are not given
CAPTION_COLUMNS = ("caption", "text", "title", "txt", "sentence", "prompt")
IMAGE_COLUMNS = ("image", "jpg", "png", "img", "image_bytes", "webp", "bytes")
PATH_COLUMNS = ("filepath", "image_path", "file_name", "path", "filename", "file")


def iter_source(source: str, *, split: str = "all", image_column: str | None = None,
                caption_column: str | None = None, separator: str | None = None
                ) -> Iterator[Any]:
    """Rows (Pair or dict pair-likes, see ``encode_pair``) of a source, in a stable order."""
    columns = dict(image_column=image_column, caption_column=caption_column)
    name = str(source)
    packaged = parse_packaged(name)
    if packaged is not None:
        source_name, size, chosen = packaged
        return iter(packaged_source(source_name).load_pairs(chosen or split, image_size=size or DEFAULT_PX))
    if name.startswith("synthetic:"):
        from . import synthetic

        parts = [int(x) for x in name.split(":")[1:]]
        return synthetic.iter_pairs(parts[0], image_size=parts[1] if len(parts) > 1 else 64)
    path = Path(source)
    if not path.exists():
        raise FileNotFoundError(f"source not found: {source}")
    suffix = path.suffix.lower()
    if path.is_file() and suffix in (".csv", ".tsv"):
        return _table_rows(path, separator or ("\t" if suffix == ".tsv" else None), **columns)
    if path.is_file() and suffix == ".parquet":
        return _parquet_rows([path], **columns)
    if not path.is_dir():
        raise ValueError(f"unsupported source {source}: expected a folder, .csv, .tsv, "
                         ".parquet, 'openmoji', 'openclipart', 'material_icons' or 'synthetic:N'")
    if (path / "dataset_dict.json").is_file() or (path / "state.json").is_file():
        return _hf_disk_rows(path, split, **columns)
    files = _walk(path)
    metadata = [f for f in files if f.name in ("metadata.jsonl", "metadata.csv") and f.is_file()]
    if metadata:
        return _imagefolder_rows(metadata, **columns)
    images = [f for f in files if f.suffix.lower().lstrip(".") in IMAGE_EXTS]
    parquets = [f for f in files if f.suffix.lower() == ".parquet" and f.is_file()]
    if parquets and not images:
        return _parquet_rows(parquets, **columns)
    if not images:
        raise ValueError(f"no images, parquet files or dataset metadata under {path}")
    return _folder_rows(path, images)


def _walk(root: Path) -> list[Path]:
    out = []
    for directory, dirs, names in os.walk(root):
        dirs[:] = sorted(d for d in dirs if not d.startswith("."))
        out += [Path(directory) / n for n in sorted(names) if not n.startswith(".")]
    return out


class _Keys:
    """Filename-safe, unique keys from names (a suffix resolves collisions)."""

    def __init__(self):
        self.used: set[str] = set()

    def __call__(self, name: str, index: int) -> str:
        from . import safe_key

        key = safe_key(name)
        if key in self.used:
            key = f"{key}_{index}"
        self.used.add(key)
        return key


def _folder_rows(root: Path, images: list[Path]) -> Iterator[dict]:
    keys = _Keys()
    for i, image in enumerate(images):
        rel = image.relative_to(root)
        sidecar = image.with_suffix(".txt")
        has_sidecar = os.path.lexists(sidecar)  # read (or refused) by read_regular, never opened here
        yield {"key": keys(str(rel.with_suffix("")), i), "image_path": str(image),
               "caption_path": str(sidecar) if has_sidecar else None,
               "caption": None if has_sidecar else "", "meta": {"path": str(rel)}}


def _pick(names: list[str], wanted: str | None, candidates: tuple, what: str,
          where: Any) -> str:
    if wanted is not None:
        if wanted not in names:
            raise ValueError(f"{where}: no {what} column {wanted!r}; columns are {names}")
        return wanted
    for name in candidates:
        if name in names:
            return name
    raise ValueError(f"{where}: no {what} column among {names}; pass it explicitly "
                     f"(tried {list(candidates)})")


def _table_rows(path: Path, separator: str | None, image_column: str | None,
                caption_column: str | None) -> Iterator[dict]:
    import csv

    with open(path, newline="", encoding="utf-8") as f:
        header = f.readline()
        sep = separator or ("\t" if "\t" in header else ",")
        f.seek(0)
        reader = csv.DictReader(f, delimiter=sep)
        names = list(reader.fieldnames or [])
        image_col = _pick(names, image_column, PATH_COLUMNS + IMAGE_COLUMNS, "image path", path)
        caption_col = _pick(names, caption_column, CAPTION_COLUMNS, "caption", path)
        yield from _path_rows(path.parent, reader, image_col, caption_col)


def _path_rows(base: Path, rows: Iterable[dict], image_col: str, caption_col: str
               ) -> Iterator[dict]:
    keys = _Keys()
    for i, row in enumerate(rows):
        rel = str(row.get(image_col) or "")
        image = base / rel if rel else None
        yield {"key": keys(str(Path(rel).with_suffix("")) if rel else f"row_{i}", i),
               "image_path": str(image) if image else None,
               "caption": row.get(caption_col) or "", "meta": {"path": rel, "row": i}}


def _imagefolder_rows(metadata: list[Path], image_column: str | None,
                      caption_column: str | None) -> Iterator[dict]:
    import csv

    for meta_path in metadata:
        if meta_path.suffix == ".jsonl":
            with open(meta_path, encoding="utf-8") as f:
                rows = [json.loads(line) for line in f if line.strip()]
        else:
            with open(meta_path, newline="", encoding="utf-8") as f:
                rows = list(csv.DictReader(f))
        names = sorted({k for row in rows for k in row})
        image_col = _pick(names, image_column, PATH_COLUMNS, "file name", meta_path)
        caption_col = _pick(names, caption_column, CAPTION_COLUMNS, "caption", meta_path)
        yield from _path_rows(meta_path.parent, rows, image_col, caption_col)


def _image_value(value: Any, base: Path) -> dict:
    """bytes | HF Image struct {bytes, path} | path string -> pair-like image fields."""
    if isinstance(value, dict):
        if value.get("bytes"):
            return {"image": bytes(value["bytes"])}
        value = value.get("path")
    if isinstance(value, (bytes, bytearray, memoryview)):
        return {"image": bytes(value)}
    if isinstance(value, str) and value:
        return {"image_path": str(base / value)}
    return {"image_path": None}


def _parquet_rows(files: list[Path], image_column: str | None, caption_column: str | None
                  ) -> Iterator[dict]:
    import pyarrow.parquet as pq

    from . import safe_key

    index = 0
    for file in files:
        parquet = pq.ParquetFile(file)
        names = parquet.schema_arrow.names
        image_col = _pick(names, image_column, IMAGE_COLUMNS + PATH_COLUMNS, "image", file)
        caption_col = _pick(names, caption_column, CAPTION_COLUMNS, "caption", file)
        key_col = "key" if "key" in names else None
        wanted = [c for c in (image_col, caption_col, key_col) if c]
        for batch in parquet.iter_batches(batch_size=256, columns=wanted):
            for row in batch.to_pylist():
                key = f"{file.stem}_{index:09d}" if key_col is None else str(row[key_col])
                yield {"key": safe_key(key), "caption": row[caption_col] or "",
                       "meta": {"source": file.name, "row": index},
                       **_image_value(row[image_col], file.parent)}
                index += 1


def _hf_disk_rows(path: Path, split: str, image_column: str | None,
                  caption_column: str | None) -> Iterator[dict]:
    import datasets

    loaded = datasets.load_from_disk(str(path))
    if isinstance(loaded, datasets.DatasetDict):
        aliases = {"train": ["train"], "eval": ["validation", "test", "eval", "val"]}
        names = sorted(loaded) if split == "all" else \
            [n for n in aliases.get(split, [split]) if n in loaded][:1]
        if not names:
            raise ValueError(f"{path}: no split for {split!r}; splits are {sorted(loaded)}")
        parts = [(n, loaded[n]) for n in names]
    else:
        parts = [("data", loaded)]
    for name, dataset in parts:
        columns = list(dataset.column_names)
        image_col = _pick(columns, image_column, IMAGE_COLUMNS + PATH_COLUMNS, "image", path)
        caption_col = _pick(columns, caption_column, CAPTION_COLUMNS, "caption", path)
        if isinstance(dataset.features[image_col], datasets.Image):
            dataset = dataset.cast_column(image_col, datasets.Image(decode=False))
        dataset = dataset.select_columns([image_col, caption_col])
        for i, row in enumerate(dataset):
            caption = row[caption_col]
            if isinstance(caption, list):  # several captions: the first (others in meta)
                caption = caption[0] if caption else ""
            yield {"key": f"{name}_{i:09d}", "caption": caption or "",
                   "meta": {"split": name, "row": i}, **_image_value(row[image_col], path)}
