"""Eval datasets: ImageNet val folders, any class-folder set, and eval shards (.tar).

All classification datasets yield (image_tensor, label) through the given transform, or a
`Skip` for an image that does not decode (corrupt, truncated, a decompression bomb), and come
with their class-name list; `make_eval_loader` batches them as (images, labels, {kind: skipped})
so skips are counted across workers. The retrieval shard dataset yields dicts like the training
stream.

Class folders are walked following symlinks, but a folder is entered once (no symlink loop, no
class folder reached from another) and a file counted once; only regular files are opened (a
FIFO cannot hang the eval).

ImageNet labels: `imagenet_synsets.txt` (next to this file) lists the 1000 ILSVRC2012 wnids in
the standard sorted order (public LOC_synset_mapping.txt copies); line i is open_clip's
IMAGENET_CLASSNAMES[i].

Shards: plain tar files in webdataset layout (members "<key>.<ext>", a sample's members
adjacent), read with the training stream's reader (vlp.data.tars). Image ext: any of
IMAGE_EXTS. Classification label: "cls" (an integer as text, CLIP_benchmark's layout).
Retrieval captions: "txt" (or the training stream's other caption members), one caption per
non-empty line (CLIP_benchmark's wds retrieval layout). This is the one retrieval reader
(docs/design.md, "Eval data").
"""
from __future__ import annotations

import os
import stat
from collections import Counter
from pathlib import Path
from typing import Callable, Iterator, Optional, Sequence, Union

import torch
from PIL import Image
from torch.utils.data import DataLoader, Dataset, IterableDataset, get_worker_info

from vlp.data.lifecycle import end_workers_at_exit, start_worker
from vlp.data.shard_io import read_small
from vlp.locations import is_url
from vlp.data.shard_list import expand_sources
from vlp.data.tars import IMAGE_EXTS, TEXT_EXTS, read_shard

IMAGE_EXTENSIONS = tuple(f".{ext}" for ext in IMAGE_EXTS)  # the shard reader's list: one definition
SYNSETS_PATH = Path(__file__).with_name("imagenet_synsets.txt")


# ----------------------------------------------------------------------------- class folders

def read_imagenet_synsets() -> list[str]:
    """The 1000 ILSVRC2012 wnids; index i ↔ open_clip.IMAGENET_CLASSNAMES[i]."""
    return [ln.strip() for ln in SYNSETS_PATH.read_text().splitlines() if ln.strip()]


def read_lines(path: Union[str, os.PathLike]) -> list[str]:
    with open(path, encoding="utf-8") as f:
        return [ln.strip() for ln in f if ln.strip()]


class Skip(str):
    """What a dataset yields instead of a sample it could not decode: the kind of skip."""


def open_rgb(source) -> Image.Image | Skip:
    """RGB image from a path or bytes, or Skip('corrupt_image' | 'too_large') for bytes PIL
    cannot decode or a decompression bomb (PIL's MAX_IMAGE_PIXELS guard)."""
    import io

    try:
        from vlp.data.rgb import to_rgb

        with Image.open(io.BytesIO(source) if isinstance(source, bytes) else source) as im:
            return to_rgb(im)  # 16-bit greyscale scaled to 8 bits, not clipped to white
    except Image.DecompressionBombError:
        return Skip("too_large")
    except (OSError, ValueError, SyntaxError, EOFError, Image.UnidentifiedImageError):
        return Skip("corrupt_image")


class LabeledImages(Dataset):
    """Map-style dataset over [(path, label)]: yields (transform(RGB PIL image), label), or a
    Skip. ``skipped``: what discovery left out ({kind: count}: special files, repeats)."""

    def __init__(self, samples: Sequence[tuple[str, int]], transform: Optional[Callable] = None,
                 skipped: Optional[dict] = None):
        self.samples = list(samples)
        self.transform = transform
        self.skipped = dict(skipped or {})

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, i: int):
        path, label = self.samples[i]
        img = open_rgb(path)
        if isinstance(img, Skip):
            return img
        return (self.transform(img) if self.transform else img), label


def collate_labeled(items: list) -> tuple[torch.Tensor, torch.Tensor, dict[str, int]]:
    """(images, labels, {kind: skipped}) from (image, label) items and Skips."""
    skipped = Counter(str(it) for it in items if isinstance(it, Skip))
    kept = [it for it in items if not isinstance(it, Skip)]
    if not kept:
        return torch.empty(0), torch.empty(0, dtype=torch.long), dict(skipped)
    images = torch.stack([im for im, _ in kept]) if isinstance(kept[0][0], torch.Tensor) else [im for im, _ in kept]
    return images, torch.tensor([int(label) for _, label in kept]), dict(skipped)


def _class_dirs(root: Union[str, os.PathLike]) -> list[str]:
    if not os.path.isdir(root):
        raise FileNotFoundError(f"dataset root {root} is not a directory")
    dirs = []
    for entry in os.scandir(root):
        try:
            is_dir = entry.is_dir()
        except OSError as e:  # a class-level symlink loop (ELOOP): its label cannot be used
            raise ValueError(f"class folder {entry.path} cannot be opened: {e.strerror}; "
                             "fix or remove that link (a class left out would change the metric)") from None
        if is_dir and not entry.name.startswith("."):
            dirs.append(entry.name)
    dirs.sort()
    if not dirs:
        raise ValueError(f"{root} has no class folders")
    return dirs


def _identity(path: str) -> Optional[tuple[int, int]]:
    """(device, inode) of what `path` points to, None if it does not resolve."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    return st.st_dev, st.st_ino


def _images_in(folder: str, seen_dirs: set, seen_files: set, skipped: Counter) -> list[str]:
    """Image files under `folder`, following symlinks into folders not seen yet (`seen_dirs`
    holds the root and every class folder: a link to another class or up the tree is not
    followed) and counting each file once (`seen_files`, by inode). Non-regular files (FIFOs,
    devices, broken links) are counted in `skipped`, never opened."""
    paths = []
    for dirpath, dirs, files in os.walk(folder, followlinks=True):
        dirs.sort()
        keep = []
        for d in dirs:
            ident = _identity(os.path.join(dirpath, d))
            if ident is None or ident in seen_dirs:
                skipped["repeated_folder"] += 1
                continue
            seen_dirs.add(ident)
            keep.append(d)
        dirs[:] = keep
        for name in sorted(files):
            if not name.lower().endswith(IMAGE_EXTENSIONS):
                continue
            path = os.path.join(dirpath, name)
            try:
                st = os.stat(path)
            except OSError:
                skipped["broken_link"] += 1
                continue
            if not stat.S_ISREG(st.st_mode):
                skipped["special_file"] += 1
            elif (st.st_dev, st.st_ino) in seen_files:
                skipped["duplicate_file"] += 1
            else:
                seen_files.add((st.st_dev, st.st_ino))
                paths.append(path)
    return sorted(paths)


def _folder_samples(root, dir_to_label: dict[str, int]) -> tuple[list[tuple[str, int]], dict[str, int]]:
    """[(path, label)] of every class folder, and {kind: count} of what was left out."""
    folders = {d: os.path.join(root, d) for d in dir_to_label}
    seen_dirs = {i for i in map(_identity, [root, *folders.values()]) if i is not None}
    seen_files: set = set()
    skipped: Counter[str] = Counter()
    samples = [(p, label) for d, label in dir_to_label.items()
               for p in _images_in(folders[d], seen_dirs, seen_files, skipped)]
    if not samples:
        raise ValueError(f"no images ({', '.join(IMAGE_EXTENSIONS)}) under {root}")
    return samples, dict(skipped)


def imagenet_folder(root, transform: Optional[Callable] = None) -> tuple[LabeledImages, list[str]]:
    """ImageNet val (or any subset of it) laid out as root/<wnid>/*.JPEG.

    Labels are the global ImageNet indices, so a subset of folders still scores against all
    1000 classes. Returns (dataset, open_clip IMAGENET_CLASSNAMES)."""
    from open_clip import IMAGENET_CLASSNAMES

    wnid_to_idx = {w: i for i, w in enumerate(read_imagenet_synsets())}
    dirs = _class_dirs(root)
    unknown = [d for d in dirs if d not in wnid_to_idx]
    if unknown:
        raise ValueError(f"{root}: folders are not ImageNet-1k wnids: {unknown[:5]}"
                         f"{' ...' if len(unknown) > 5 else ''}")
    samples, skipped = _folder_samples(root, {d: wnid_to_idx[d] for d in dirs})
    return LabeledImages(samples, transform, skipped), list(IMAGENET_CLASSNAMES)


def class_folder(root, transform: Optional[Callable] = None,
                 classnames: Union[None, str, Sequence[str]] = None) -> tuple[LabeledImages, list[str]]:
    """Any root/<class_folder>/* set; label = index of the folder in sorted order.

    classnames: None → folder names with "_" replaced by spaces; a path → a text file with one
    name per line in sorted-folder order; a list → used as is (same order)."""
    dirs = _class_dirs(root)
    if classnames is None:
        names = [d.replace("_", " ") for d in dirs]
    else:
        names = read_lines(classnames) if isinstance(classnames, (str, os.PathLike)) else list(classnames)
        if len(names) != len(dirs):
            raise ValueError(f"{len(names)} class names for {len(dirs)} folders in {root}")
    samples, skipped = _folder_samples(root, {d: i for i, d in enumerate(dirs)})
    return LabeledImages(samples, transform, skipped), names


# ----------------------------------------------------------------------------- shards

def expand_shards(spec: Union[str, Sequence[str]]) -> list[str]:
    """A brace pattern ("eval/{000..009}.tar"), a glob, a directory (its sizes.json shards, else
    its *.tar, sorted), a "::"-joined string of those, or a list of those → list of tar paths
    (order kept). The training stream's rules (vlp.data.shard_list.expand_sources)."""
    parts = [spec] if isinstance(spec, str) else list(spec)
    return [p for source in expand_sources("::".join(str(p) for p in parts)) for p in source]


def iter_tar_samples(path: str) -> Iterator[dict[str, bytes]]:
    """Samples of a tar as {"__key__": key, ext: bytes}, every member kept (webdataset's grouping
    rule, vlp.data.tars). Eval sets are read whole: an unreadable shard or member is an
    error, not a skip."""
    skipped: Counter[str] = Counter()
    for _, key, members in read_shard(path, 0, None, skipped, exts=None):
        yield {"__key__": key, **members}
    if skipped:
        from vlp.data.tars import read_head, describe_unreadable

        raise ValueError(f"eval shard {path} is unreadable ({describe_unreadable(read_head(path))}); "
                         "eval shards must be complete")


def _decode_image(sample: dict) -> Optional[Image.Image | Skip]:
    ext = next((e for e in IMAGE_EXTS if e in sample), None)
    return None if ext is None else open_rgb(sample[ext])


class _ShardIterable(IterableDataset):
    """Reads shards in order; DataLoader workers take every num_workers-th shard."""

    def __init__(self, shards, transform: Optional[Callable]):
        self.urls = expand_shards(shards)
        self.transform = transform

    def _my_samples(self) -> Iterator[dict]:
        info = get_worker_info()
        wid, nw = (info.id, info.num_workers) if info else (0, 1)
        for url in self.urls[wid::nw]:
            yield from iter_tar_samples(url)

    def _image(self, sample):
        img = _decode_image(sample)
        if img is None:
            raise ValueError(f"sample {sample['__key__']} has no image (found {sorted(sample)})")
        if isinstance(img, Skip):
            return img
        return self.transform(img) if self.transform else img


class ShardClassification(_ShardIterable):
    """Eval shards with an integer "cls" member per sample → (image, label)."""

    def __iter__(self):
        for sample in self._my_samples():
            if "cls" not in sample:
                raise ValueError(f"sample {sample['__key__']} has no 'cls' label (found {sorted(sample)})")
            image = self._image(sample)
            yield image if isinstance(image, Skip) else (image, int(sample["cls"].decode().strip()))


class ShardRetrieval(_ShardIterable):
    """Eval shards with image + "txt" (one caption per non-empty line) →
    {"image": tensor, "text": LongTensor[K, L], "key": str}; batch with `collate_retrieval`."""

    def __init__(self, shards, transform: Optional[Callable], tokenizer: Callable):
        super().__init__(shards, transform)
        self.tokenizer = tokenizer

    def __iter__(self):
        for sample in self._my_samples():
            caps = captions_of(sample)
            if not caps:
                raise ValueError(f"sample {sample['__key__']} has no caption ({', '.join(TEXT_EXTS)})")
            image = self._image(sample)
            yield image if isinstance(image, Skip) else {"image": image, "text": self.tokenizer(caps),
                                                         "key": sample["__key__"]}


def captions_of(sample: dict) -> list[str]:
    """The captions of a sample: its first caption member (TEXT_EXTS, the training stream's
    names) split into non-empty lines. A literal backslash-n inside a line is a newline of that
    caption (CLIP_benchmark escapes captions that way when it joins them with newlines)."""
    ext = next((e for e in TEXT_EXTS if e in sample), None)
    if ext is None:
        return []
    lines = sample[ext].decode("utf-8").splitlines()
    return [line.strip().replace("\\n", "\n") for line in lines if line.strip()]


def collate_retrieval(items: list) -> dict:
    """Stack images; keep per-sample caption tensors as a list (K varies); keys as a list;
    "skipped": {kind: count} of the Skips among the items."""
    kept = [it for it in items if not isinstance(it, Skip)]
    return {"image": torch.stack([it["image"] for it in kept]) if kept else torch.empty(0),
            "text": [it["text"] for it in kept],
            "key": [it["key"] for it in kept],
            "skipped": dict(Counter(str(it) for it in items if isinstance(it, Skip)))}


def shard_side_file(shards, name: str) -> Optional[str]:
    """Path of file `name` beside the first (local) shard or one level up, else None."""
    shard = expand_shards(shards)[0]
    if is_url(shard):
        return None
    first = Path(shard).parent
    for cand in (first / name, first.parent / name):
        if cand.is_file():
            return str(cand)
    return None


def shard_classnames(shards, classnames: Union[None, str, Sequence[str]]) -> list[str]:
    """classnames given (path or list), else classnames.txt beside the first shard or one level up
    (CLIP_benchmark's wds layout: <root>/classnames.txt, <root>/test/0.tar)."""
    if classnames is not None:
        return read_lines(classnames) if isinstance(classnames, (str, os.PathLike)) else list(classnames)
    shard = expand_shards(shards)[0]
    if is_url(shard):  # remote shards: the same two places, fetched (vlp.data.shard_io)
        here = shard.rsplit("/", 1)[0]
        for cand in (f"{here}/classnames.txt", f"{here.rsplit('/', 1)[0]}/classnames.txt"):
            data = read_small(cand)
            if data is not None:
                return [ln.strip() for ln in data.decode("utf-8").splitlines() if ln.strip()]
        raise ValueError(f"no class names given and no classnames.txt next to {here}")
    first = Path(shard).parent
    for cand in (first / "classnames.txt", first.parent / "classnames.txt"):
        if cand.is_file():
            return read_lines(cand)
    raise ValueError(f"no class names given and no classnames.txt next to {first}")


def make_eval_loader(dataset, batch_size: int = 64, num_workers: int = 0, collate_fn=None) -> DataLoader:
    """Sequential, non-shuffled DataLoader (all samples exactly once, in order). Classification
    batches default to `collate_labeled`'s (images, labels, {kind: skipped})."""
    collate_fn = collate_fn or collate_labeled
    if num_workers:
        end_workers_at_exit()  # its workers ignore SIGTERM (vlp.data.lifecycle)
    return DataLoader(dataset, batch_size=batch_size, shuffle=False, num_workers=num_workers,
                      collate_fn=collate_fn, pin_memory=torch.cuda.is_available(),
                      persistent_workers=False, worker_init_fn=start_worker)  # ignores the stop signals
