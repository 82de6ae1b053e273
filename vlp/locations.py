"""Where a path lives, and the one door to fsspec (ground floor: imports nothing of vlp).

- ``is_url(spec)``: it has a scheme ('s3://b/k', 'file:///d/x.tar', 'https://h/x.tar');
- ``is_local(spec)``: it names this machine's file system (a plain path, or a 'file://' URL);
- ``is_streamed(spec)``: it is read as a stream, not opened as a local file ('pipe:COMMAND', a URL);
- ``join(base, name)``: ``name`` inside ``base``, a folder or a URL;
- ``filesystem(url)``: fsspec's (filesystem, path inside it); ``has_backend`` / ``missing_backend``:
  whether the URL's scheme can be opened here, and what to install where it cannot.
"""

from __future__ import annotations

import re
from pathlib import Path

PIPE = "pipe:"  # 'pipe:COMMAND': the stdout of a shell command (vlp.data.shard_io)
_SCHEME = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*://")
_EXTRAS = {"s3": "vlp[s3]", "s3a": "vlp[s3]", "gs": "vlp[gcs]", "gcs": "vlp[gcs]"}  # pip extras of the backends


def is_url(spec) -> bool:
    """An fsspec URL ('s3://b/k', 'file:///d/x.tar', 'https://h/x.tar')."""
    return bool(_SCHEME.match(str(spec)))


def is_local(spec) -> bool:
    """A plain path or a 'file://' URL; not a URL that fsspec reaches on another machine."""
    return not is_url(spec) or str(spec).startswith("file://")


def join(base, name: str) -> str:
    """``name`` inside ``base``: a path or a URL ('s3://b/grid' + 'run' -> 's3://b/grid/run')."""
    return f"{str(base).rstrip('/')}/{name}" if is_url(base) else str(Path(base) / name)


def is_streamed(spec: str) -> bool:
    """Read as a stream (a pipe: command or an fsspec URL, file:// included), not opened as a
    local file. The cheap test comes first: shard lists ask it of every shard."""
    return spec.startswith(PIPE) or ("://" in spec and is_url(spec))


def filesystem(url, **storage_options):
    """fsspec's (filesystem, path inside it) for `url`; an ImportError saying what to install
    where the scheme's backend is missing."""
    import fsspec

    try:
        return fsspec.core.url_to_fs(str(url), **storage_options)
    except ImportError:
        raise ImportError(missing_backend(str(url))) from None


def has_backend(url: str) -> bool:
    """Whether fsspec can open this URL's scheme here (s3fs, gcsfs... installed)."""
    import fsspec

    try:
        fsspec.get_filesystem_class(url.split("://", 1)[0])
    except (ImportError, ValueError):
        return False
    return True


def missing_backend(url: str) -> str:
    """What to install when `has_backend(url)` is False, in words."""
    scheme = url.split("://", 1)[0]
    hint = f"pip install '{_EXTRAS[scheme]}'" if scheme in _EXTRAS else f"install the fsspec backend for {scheme}://"
    return f"no storage backend for {scheme}:// is installed ({hint})"
