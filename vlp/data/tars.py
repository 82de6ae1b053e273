"""Webdataset-format tar shards: the streaming member reader and sample checks (shard specs and
sizes: vlp.data.shard_list).

A shard is a tar whose members `dir/key.ext` group into samples by key (webdataset's
convention); an image member (IMAGE_EXTS) and a caption member (TEXT_EXTS) make a sample.
"""

from __future__ import annotations

import io
import os
import sys
import tarfile
from collections import Counter
from collections.abc import Callable, Iterator
from typing import NamedTuple

from vlp.data.shard_io import Retry, ShardReadError, open_shard

IMAGE_EXTS = ("jpg", "jpeg", "png", "webp", "bmp", "gif", "tif", "tiff")  # first present wins
TEXT_EXTS = ("txt", "text", "caption")


def read_head(path: str, size: int = tarfile.BLOCKSIZE) -> bytes:
    try:
        with open_shard(path, Retry(0, 0.0)) as f:  # local or remote (one try: for a message)
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
def split_name(name: str) -> tuple[str, str]:
    """webdataset convention: 'dir/key.a.b' -> ('dir/key', 'a.b')."""
    directory, base = os.path.split(name)
    stem, _, ext = base.partition(".")
    return os.path.join(directory, stem), ext.lower()


def read_shard(path: str, start: int, stop: int | None, skipped: Counter,
                want: Callable[[int], bool] | None = None, seen_exts: set | None = None,
                exts: tuple[str, ...] | None = IMAGE_EXTS + TEXT_EXTS, retry: Retry = Retry(),
                errors: list[str] | None = None) -> Iterator[tuple[int, str, dict]]:
    """Yield (index in shard, key, {ext: bytes}) for samples start <= index < stop, with the
    members whose extension is in ``exts`` (None: every member).

    Streams member by member; skipped samples cost headers only (local files seek; remote
    shards read through the bytes, shard_io). A sample is yielded once the next sample's header
    is read or the archive's end marker is seen, so a truncated tar yields its complete samples
    and counts the one in progress as 'bad_member'. An unopenable tar, or a remote shard that
    still fails after ``retry`` (open or mid-stream), counts one 'bad_shard' (with a warning on
    stderr): the samples yielded before the failure stay, the one in progress is dropped.
    ``errors`` (if given) receives a line per bad shard.
    """
    fileobj = None
    try:
        fileobj = open_shard(path, retry)
        tar = tarfile.open(fileobj=fileobj, mode="r:")
    except (OSError, tarfile.TarError, EOFError) as e:
        if fileobj is not None:
            fileobj.close()
        if errors is not None:  # the caller reports it with the count (vlp.data.stream)
            errors.append(str(e) if isinstance(e, ShardReadError) else
                          f"{path}: {type(e).__name__}: {e}")
        elif isinstance(e, ShardReadError):
            _warn_bad_shard(e)
        skipped["bad_shard"] += 1
        return
    try:
        with fileobj, tar:
            yield from _samples(tar, start, stop, skipped, want, seen_exts, exts)
    except ShardReadError as e:
        if errors is not None:
            errors.append(str(e))
        else:
            _warn_bad_shard(e)
        skipped["bad_shard"] += 1
    finally:
        tar.members = []  # release the member index of big shards


def _next_member(tar: tarfile.TarFile) -> tuple[tarfile.TarInfo | None, bool]:
    """(the next member or None at the end, whether the end is a cut-off rather than the end
    marker). A remote read that still fails after its retries (ShardReadError) propagates."""
    try:
        info = tar.next()
        return info, info is None and not _at_end_marker(tar)
    except ShardReadError:
        raise
    except (OSError, tarfile.TarError, EOFError):
        return None, True


class Member(NamedTuple):
    """A regular file's header read by ``_plain_header`` (``tarinfo`` None) or by tarfile."""

    name: str
    size: int
    offset_data: int
    tarinfo: tarfile.TarInfo | None = None

    def isfile(self) -> bool:
        return self.tarinfo is None or self.tarinfo.isfile()


def _plain_header(tar: tarfile.TarFile) -> Member | None:
    """The member at ``tar.offset`` when its header is a plain ustar/GNU header of a regular file
    or a directory, read as tarfile reads it (name with the ustar prefix, octal size, checksum)
    without building a TarInfo; ``tar.offset`` then moves past it. None for anything else (the
    end, a short or bad block, pax or GNU long-name headers, base-256 sizes, other types), and
    after a global pax header: tarfile then reads it, from the same offset."""
    if tar.pax_headers:
        return None
    tar.fileobj.seek(tar.offset)
    buf = tar.fileobj.read(tarfile.BLOCKSIZE)
    kind = buf[156:157]
    if len(buf) != tarfile.BLOCKSIZE or buf[257:262] != b"ustar" or kind not in (b"0", b"\0", b"5") \
            or buf[124] & 0x80:
        return None
    try:
        checksum = int(buf[148:156].split(b"\0", 1)[0].strip() or b"0", 8)
        size = int(buf[124:136].split(b"\0", 1)[0].strip() or b"0", 8)
    except ValueError:
        return None
    if checksum != 256 + sum(buf[:148]) + sum(buf[156:]):  # the checksum field counts as spaces
        return None
    name = buf[:100].split(b"\0", 1)[0]
    prefix = buf[345:500].split(b"\0", 1)[0] if buf[257:265] == tarfile.POSIX_MAGIC else b""
    name = (prefix + b"/" + name if prefix else name).decode(tar.encoding, tar.errors)
    offset_data = tar.offset + tarfile.BLOCKSIZE
    if kind == b"5" or name.endswith("/"):  # a directory: no data follows (as in tarfile)
        tar.offset = offset_data
        return Member(name.rstrip("/"), 0, offset_data, tarinfo=_DIRECTORY)
    tar.offset = offset_data + -(-size // tarfile.BLOCKSIZE) * tarfile.BLOCKSIZE
    return Member(name, size, offset_data)


_DIRECTORY = tarfile.TarInfo()
_DIRECTORY.type = tarfile.DIRTYPE


def _read_member(tar: tarfile.TarFile, member: Member) -> bytes:
    if member.tarinfo is not None:
        return tar.extractfile(member.tarinfo).read()
    tar.fileobj.seek(member.offset_data)
    data = tar.fileobj.read(member.size)
    if len(data) != member.size:
        raise tarfile.ReadError("unexpected end of data")  # as tarfile's reader says it
    return data


def _next(tar: tarfile.TarFile, plain: bool) -> tuple[Member | None, bool, bool]:
    """``_next_member`` through ``_plain_header`` while ``plain`` (no header refused yet; the
    first member is tarfile's, read when the tar was opened), and whether to stay plain."""
    if plain and tar.firstmember is None:
        member = _plain_header(tar)
        if member is not None:
            return member, False, True
        plain = False  # tarfile reads this header and every one after it
    info, truncated = _next_member(tar)
    return (None if info is None else Member(info.name, info.size, info.offset_data, info)), truncated, plain


def _samples(tar: tarfile.TarFile, start: int, stop: int | None, skipped: Counter,
             want: Callable[[int], bool] | None, seen_exts: set | None,
             exts: tuple[str, ...] | None) -> Iterator[tuple[int, str, dict]]:
    """read_shard's member loop over an open tar (see there). Plain headers are read by
    ``_plain_header`` (tarfile's Python header parsing is most of a shard's read cost); from the
    first header it does not take on, tarfile reads every header."""
    index, key, members = -1, None, {}
    keep, plain = False, True
    while True:
        info, truncated, plain = _next(tar, plain)
        if info is None:
            if keep and not truncated:
                yield index, key, members
            elif keep:
                skipped["bad_member"] += 1
            return
        if not info.isfile():
            continue
        prefix, ext = split_name(info.name)
        if seen_exts is not None and len(seen_exts) < 32:
            seen_exts.add(ext)
        if prefix != key:
            tar.members.clear()  # tarfile indexes every member: bounded memory per shard
            if keep:
                yield index, key, members
            index, key, members = index + 1, prefix, {}
            if stop is not None and index >= stop:
                return
            keep = index >= start and (want is None or want(index))
        if keep and (exts is None or ext in exts):
            try:
                members[ext] = _read_member(tar, info)
            except ShardReadError:
                raise
            except (OSError, tarfile.TarError, EOFError):
                skipped["bad_member"] += 1
                return


def _warn_bad_shard(error) -> None:
    """One stderr line per shard given up on (the run goes on; counts go to 'bad_shard')."""
    print(f"vlp: warning: skipping shard: {error}", file=sys.stderr, flush=True)


warn_bad_shard = _warn_bad_shard  # the stream prints a worker's lines when their counts arrive


def _at_end_marker(tar: tarfile.TarFile) -> bool:
    """True if the archive ends with a zero block (a cut-off tar does not)."""
    tar.fileobj.seek(tar.offset)
    block = tar.fileobj.read(tarfile.BLOCKSIZE)
    return len(block) == tarfile.BLOCKSIZE and block.count(0) == tarfile.BLOCKSIZE


def check_sample(key: str, members: dict, url: str) -> tuple | str:
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
    """Whether the image bytes decode (vlp.data.rgb.decode_rgb), at a fraction of the cost: JPEGs decode at 1/8
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

