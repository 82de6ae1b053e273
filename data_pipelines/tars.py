"""Webdataset-format tar shards: shard specs, sizes, streaming member reader, sample checks.

A shard is a tar whose members `dir/key.ext` group into samples by key (webdataset's
convention); an image member (IMAGE_EXTS) and a caption member (TEXT_EXTS) make a sample.
"""

from __future__ import annotations

import glob
import io
import json
import os
import tarfile
from collections import Counter
from collections.abc import Callable, Iterator

IMAGE_EXTS = ("jpg", "jpeg", "png", "webp", "bmp", "gif", "tif", "tiff")  # first present wins
TEXT_EXTS = ("txt", "text", "caption")


# ----------------------------------------------------------------------------- shard lists
def expand_sources(urls: str) -> list[list[str]]:
    """'a-{0..3}.tar::b.tar' -> [[a-0.tar, .., a-3.tar], [b.tar]]; raises FileNotFoundError
    for a missing path. A directory stands for the shards listed in its sizes.json (else its
    *.tar, sorted); a glob ('d/*.tar') for its sorted matches."""
    import braceexpand

    sources, missing = [], []
    for part in str(urls).split("::"):
        part = part.strip()
        if not part:
            continue
        paths = []
        for path in braceexpand.braceexpand(part):
            if os.path.isdir(path):
                names = list(_read_sizes(path)) or sorted(glob.glob("*.tar", root_dir=path))
                paths += [os.path.join(path, n) for n in names]
            elif any(ch in path for ch in "*?["):
                matches = sorted(glob.glob(path))
                paths += matches
                missing += [] if matches else [path]
            elif not os.path.isfile(path):
                missing.append(path)
            else:
                paths.append(path)
        if not paths and not missing:
            raise FileNotFoundError(f"no shards in {part!r} (a directory without sizes.json or .tar files)")
        sources.append(paths)
    if missing:
        raise FileNotFoundError(f"{len(missing)} shard(s) not found: {', '.join(missing[:5])}"
                                + (" ..." if len(missing) > 5 else ""))
    if not sources:
        raise ValueError(f"empty shard spec {urls!r}")
    return sources


def _read_sizes(directory: str) -> dict[str, int]:
    path = os.path.join(directory, "sizes.json")
    if not os.path.isfile(path):
        return {}
    with open(path) as f:
        return {str(k): int(v) for k, v in json.load(f).items()}


def shard_sizes(paths: list[str]) -> list[int]:
    """Samples per shard from sizes.json beside each shard (counted from the tar if absent)."""
    cache: dict[str, dict[str, int]] = {}
    sizes = []
    for path in paths:
        directory, name = os.path.split(os.path.abspath(path))
        table = cache.setdefault(directory, _read_sizes(directory))
        sizes.append(table[name] if name in table else _count_samples(path))
    return sizes


def sizes_from_spec(urls: str) -> int:
    """Total samples of a (brace / '::') shard spec, from sizes.json."""
    return sum(shard_sizes([p for src in expand_sources(urls) for p in src]))


def _count_samples(path: str) -> int:
    """Samples in a tar without sizes.json (headers only; stops at the first error). A file
    with no readable sample at all is an error naming the file and why (describe_unreadable):
    otherwise it would silently count 0 and appear in no count."""
    count, last = 0, None
    try:
        with tarfile.open(path, "r:") as tar:
            for info in tar:
                prefix = _split_name(info.name)[0]
                if info.isfile() and prefix != last:
                    count, last = count + 1, prefix
    except (OSError, tarfile.TarError, EOFError):
        if count == 0:
            raise ValueError(f"shard {path} is unreadable: {describe_unreadable(_head(path))}") from None
    return count


def _head(path: str, size: int = tarfile.BLOCKSIZE) -> bytes:
    try:
        with open(path, "rb") as f:
            return f.read(size)
    except OSError:
        return b""


_COMPRESSED = {b"\x1f\x8b": "gzip", b"BZh": "bzip2", b"\xfd7zXZ\x00": "xz", b"(\xb5/\xfd": "zstd",
               b"PK\x03\x04": "zip"}


def describe_unreadable(first_bytes: bytes) -> str:
    """Why a shard whose first bytes are these is no readable tar, in words for the user."""
    if not first_bytes:
        return "empty file (0 bytes)"
    for magic, kind in _COMPRESSED.items():
        if first_bytes.startswith(magic):
            return f"{kind}-compressed, not a plain tar (decompress it or write plain .tar shards)"
    if first_bytes[257:262] == b"ustar":
        return "a tar cut off or damaged after its first header (truncated)"
    if len(first_bytes) < tarfile.BLOCKSIZE:
        return f"truncated: {len(first_bytes)} bytes, less than one tar header"
    return f"not a tar archive (starts with {first_bytes[:8]!r})"


# ----------------------------------------------------------------------------- reading tars
def _split_name(name: str) -> tuple[str, str]:
    """webdataset convention: 'dir/key.a.b' -> ('dir/key', 'a.b')."""
    directory, base = os.path.split(name)
    stem, _, ext = base.partition(".")
    return os.path.join(directory, stem), ext.lower()


def _read_shard(path: str, start: int, stop: int | None, skipped: Counter,
                want: Callable[[int], bool] | None = None, seen_exts: set | None = None,
                exts: tuple[str, ...] | None = IMAGE_EXTS + TEXT_EXTS,
                ) -> Iterator[tuple[int, str, dict]]:
    """Yield (index in shard, key, {ext: bytes}) for samples start <= index < stop, with the
    members whose extension is in ``exts`` (None: every member).

    Streams member by member (random access to skip, so skipped samples cost headers only).
    A sample is yielded once the next sample's header is read or the archive's end marker is
    seen, so a truncated tar yields its complete samples and counts the one in progress as
    'bad_member'. An unopenable tar counts one 'bad_shard'.
    """
    try:
        fileobj = open(path, "rb")
        tar = tarfile.open(fileobj=fileobj, mode="r:")
    except (OSError, tarfile.TarError, EOFError):
        skipped["bad_shard"] += 1
        return
    index, key, members = -1, None, {}
    keep = False
    try:
        with fileobj, tar:
            while True:
                try:
                    info = tar.next()
                except (OSError, tarfile.TarError, EOFError):
                    info, truncated = None, True
                else:
                    truncated = info is None and not _at_end_marker(tar)
                if info is None:
                    if keep and not truncated:
                        yield index, key, members
                    elif keep:
                        skipped["bad_member"] += 1
                    return
                if not info.isfile():
                    continue
                prefix, ext = _split_name(info.name)
                if seen_exts is not None and len(seen_exts) < 32:
                    seen_exts.add(ext)
                if prefix != key:
                    if keep:
                        yield index, key, members
                    index, key, members = index + 1, prefix, {}
                    if stop is not None and index >= stop:
                        return
                    keep = index >= start and (want is None or want(index))
                if keep and (exts is None or ext in exts):
                    try:
                        members[ext] = tar.extractfile(info).read()
                    except (OSError, tarfile.TarError, EOFError):
                        skipped["bad_member"] += 1
                        return
    finally:
        tar.members = []  # release the member index of big shards


def _at_end_marker(tar: tarfile.TarFile) -> bool:
    """True if the archive ends with a zero block (a cut-off tar does not)."""
    tar.fileobj.seek(tar.offset)
    block = tar.fileobj.read(tarfile.BLOCKSIZE)
    return len(block) == tarfile.BLOCKSIZE and block.count(0) == tarfile.BLOCKSIZE


def _check_sample(key: str, members: dict, url: str) -> tuple | str:
    """(key, image bytes, caption) of a usable sample, or the kind of skip.

    Only the image header is parsed here (PIL's open: rejects bytes that are no image). Whether
    the pixel data decodes is decided where it is decoded: the stream replaces a sample that
    fails to decode by the next one, and ``image_decodes`` answers the same question cheaply
    for batches skipped on resume."""
    from PIL import Image

    image_ext = next((e for e in IMAGE_EXTS if e in members), None)
    text_ext = next((e for e in TEXT_EXTS if e in members), None)
    if image_ext is None:
        return "missing_image"
    if text_ext is None:
        return "missing_caption"
    try:
        caption = members[text_ext].decode("utf-8").strip()
    except UnicodeDecodeError:
        return "bad_member"
    if not caption:
        return "missing_caption"
    data = members[image_ext]
    try:
        Image.open(io.BytesIO(data)).close()
    except Exception:  # PIL raises many types for bad bytes
        return "corrupt_image"
    return os.path.basename(key), data, caption


def image_decodes(data: bytes) -> bool:
    """Whether ``decode_image(data)`` succeeds, at a fraction of its cost: JPEGs decode at 1/8
    DCT scale (the same entropy decoding, so the same errors), other formats run PIL's verify()
    (chunk checksums: truncation and corruption)."""
    from PIL import Image

    try:
        with Image.open(io.BytesIO(data)) as image:
            if image.format == "JPEG":
                image.draft("RGB", (1, 1))
                image.load()
            else:
                image.verify()
    except Exception:  # PIL raises many types for bad bytes
        return False
    return True


def decode_image(data: bytes, decode_size: int | None = None):
    """PIL RGB image from bytes; JPEGs are DCT-downscaled while both sides stay >= size."""
    from PIL import Image

    image = Image.open(io.BytesIO(data))
    if decode_size and image.format == "JPEG":
        image.draft("RGB", (decode_size, decode_size))
    return image.convert("RGB")
