"""One opener for shard bytes: local paths, fsspec URLs and ``pipe:COMMAND`` specs.

    with open_shard("s3://bucket/00001.tar", Retry(retries=3, backoff_s=1.0)) as f:
        tar = tarfile.open(fileobj=f, mode="r:")   # reads forward; a skip seeks or reads through

* a local path opens as a plain file (the fast path: real seeks, no extra buffer);
* ``scheme://...`` goes through fsspec (``s3://`` needs s3fs, ``gs://`` gcsfs, ``hf://``
  huggingface_hub, ``http(s)://`` aiohttp; ``file://`` always works). HTTP is read as one
  streamed GET (no Range requests: plain servers such as python's http.server ignore them);
* ``pipe:COMMAND`` runs COMMAND in a shell and reads its stdout (webdataset / open_clip
  convention, e.g. ``pipe:aws s3 cp s3://bucket/00001.tar -``); closing kills the process
  group, and a nonzero exit status is a read error.

Remote specs are read through ``ShardStream``: a forward-only, bounded-memory reader (a 1 MiB
buffer that keeps the last 64 KiB for tarfile's short backward seeks). A failed open or read is
retried as docs/data.md ("Flaky networks") says, continuing at the same byte offset (seeking
where the source can, reading through the consumed bytes where it cannot); a source that still
fails raises ``ShardReadError``; a permanent error (not found, no permission, a missing fsspec
backend, HTTP 4xx) is not retried.
"""

from __future__ import annotations

import io
import os
import signal
import subprocess
import tempfile
import time
from dataclasses import dataclass
from typing import BinaryIO

from vlp.locations import PIPE, filesystem, is_streamed


@dataclass(frozen=True)
class Retry:
    """How often and how patiently a failed shard read is retried (data.io_retries and
    data.io_backoff_s): waits backoff_s, 2*backoff_s, 4*backoff_s, ... between attempts."""

    retries: int = 3
    backoff_s: float = 1.0

    def __post_init__(self):
        if self.retries < 0 or self.backoff_s < 0:
            raise ValueError(f"io retries must be >= 0 and backoff >= 0, got {self}")

    def wait(self, attempt: int) -> float:
        return self.backoff_s * 2 ** attempt


class ShardReadError(OSError):
    """A shard that could not be read even after the retries (counted as 'bad_shard')."""


def _permanent(exc: BaseException) -> bool:
    """Errors a retry cannot mend: missing object, access denied, no backend, HTTP 4xx."""
    if isinstance(exc, FileNotFoundError) and exc.__cause__ is not None:
        return _permanent(exc.__cause__)  # fsspec's "not found" for any failed probe
    if isinstance(exc, (FileNotFoundError, PermissionError, IsADirectoryError,
                        NotADirectoryError, ImportError, ValueError)):
        return True
    status = getattr(exc, "status", None)  # aiohttp.ClientResponseError and the like
    return isinstance(status, int) and 400 <= status < 500 and status not in (408, 429)


# ----------------------------------------------------------------------------- raw sources
class _Pipe:
    """stdout of ``sh -c COMMAND`` as a file; EOF with a nonzero exit status raises OSError."""

    def __init__(self, command: str):
        self.command = command
        self._err = tempfile.TemporaryFile()  # a file, not a pipe: a chatty stderr cannot block
        self.proc = subprocess.Popen(command, shell=True, stdout=subprocess.PIPE, stderr=self._err,
                                     stdin=subprocess.DEVNULL, start_new_session=True)

    def read(self, n: int = -1) -> bytes:
        data = self.proc.stdout.read(n)
        if not data and n != 0:
            code = self.proc.wait()
            if code != 0:
                self._err.seek(0)
                tail = self._err.read()[-300:].decode("utf-8", "replace").strip().splitlines()
                raise OSError(f"pipe:{self.command} exited with status {code}"
                              + (f": {tail[-1]}" if tail else ""))
        return data

    def close(self) -> None:
        if self.proc.poll() is None:  # stopped early: end the whole command (shell + children)
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self.proc.wait()
        self.proc.stdout.close()
        self._err.close()


def _open_url(url: str):
    """An fsspec file for reading; HTTP as one streamed GET (block_size=0)."""
    fs, path = filesystem(url)
    if "http" in fs.protocol or "https" in fs.protocol:
        # block_size=0: one streamed GET (says seekable, is not). size=: any value skips
        # fsspec's HEAD probe, a round trip that reports every failure as FileNotFoundError
        # (the GET itself raises FileNotFoundError for a 404 only); the stream ignores it.
        return fs.open(path, "rb", block_size=0, size=-1), False
    f = fs.open(path, "rb")
    return f, _seekable(f)


def _open_raw(spec: str):
    """(file, whether it can seek) for a remote spec."""
    return (_Pipe(spec[len(PIPE):]), False) if spec.startswith(PIPE) else _open_url(spec)


# ----------------------------------------------------------------------------- the reader
class ShardStream(io.RawIOBase):
    """Forward reader over a remote spec with bounded memory and retries (module docstring).

    ``seek`` forward past the buffer seeks the source when it can (s3, gcs, file://) and
    reads through the bytes otherwise (http, pipe:); backward only within the kept tail."""

    CHUNK = 1 << 20
    KEEP = 1 << 16

    def __init__(self, spec: str, retry: Retry = Retry()):
        super().__init__()
        self.spec, self.retry = spec, retry
        self._raw, self._can_seek = None, False
        self._buf = b""      # bytes [_start, _start + len(_buf)) of the shard
        self._start = 0
        self._pos = 0
        self.reopened = 0    # retries that reopened the source (tests and logs)
        self._attempt(lambda: None)  # open now: a missing shard fails at open, as a file does

    # -- source handling
    @property
    def _end(self) -> int:
        return self._start + len(self._buf)

    def _connect(self) -> None:
        """(Re)open the source positioned at _end (the next byte not yet in the buffer)."""
        raw, self._can_seek = _open_raw(self.spec)
        try:
            if self._end and self._can_seek:
                raw.seek(self._end)
            else:
                left = self._end
                while left:
                    got = raw.read(min(left, self.CHUNK))
                    if not got:
                        raise OSError(f"{self.spec}: source ended at byte {self._end - left} "
                                      f"on reopen, before byte {self._end}")
                    left -= len(got)
        except BaseException:
            _close_quietly(raw)
            raise
        self._raw = raw

    def _attempt(self, op):
        """Run op() on an open source; on a transient error reopen and retry with backoff."""
        failures = 0
        while True:
            try:
                if self._raw is None:
                    self._connect()
                return op()
            except Exception as e:  # noqa: BLE001 (backends raise many types: aiohttp, botocore)
                _close_quietly(self._raw)
                self._raw = None
                if _permanent(e):
                    raise ShardReadError(f"{self.spec}: {e}") from e
                if failures >= self.retry.retries:
                    raise ShardReadError(f"{self.spec}: {type(e).__name__}: {e} "
                                         f"(after {failures} retries)") from e
                time.sleep(self.retry.wait(failures))
                failures += 1
                self.reopened += 1

    def _fill(self, size: int) -> bool:
        """Append up to ``size`` new bytes to the buffer (keeping KEEP bytes behind the read
        position); False at the end of the source."""
        data = self._attempt(lambda: self._raw.read(size))
        if not data:
            return False
        drop = max(0, min(self._pos - self._start - self.KEEP, len(self._buf)))
        self._buf, self._start = self._buf[drop:] + data, self._start + drop
        return True

    def _skip_to(self, target: int) -> None:
        """Move the source to ``target`` > _end (seek if it can, else read through), dropping
        the buffer; stops early at the end of the source."""
        if self._can_seek:  # known from the last open; _attempt reopens if needed
            self._attempt(lambda: self._raw.seek(target))
            self._buf, self._start = b"", target
            return
        while self._end < target:
            want = min(target - self._end, self.CHUNK)
            data = self._attempt(lambda: self._raw.read(want))
            if not data:
                return
            self._buf, self._start = b"", self._end + len(data)

    # -- file interface (what tarfile uses)
    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True  # forward anywhere, backward within the kept tail

    def tell(self) -> int:
        return self._pos

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        """Only moves the position; the next read() does the I/O."""
        if whence == io.SEEK_END:
            raise io.UnsupportedOperation(f"{self.spec}: cannot seek from the end of a stream")
        target = offset if whence == io.SEEK_SET else self._pos + offset
        if target < self._start:
            raise io.UnsupportedOperation(f"{self.spec}: cannot seek back to {target} "
                                          f"(kept bytes start at {self._start})")
        self._pos = target
        return target

    def read(self, n: int = -1) -> bytes:
        if self._pos > self._end:  # a seek went past the buffered bytes
            self._skip_to(self._pos)
        parts = []
        while n != 0:
            i = self._pos - self._start
            if i >= len(self._buf):
                if not self._fill(max(n, self.CHUNK)):
                    break
                continue
            piece = self._buf[i:] if n < 0 else self._buf[i:i + n]
            parts.append(piece)
            self._pos += len(piece)
            n = n - len(piece) if n > 0 else n
        return b"".join(parts)

    def readinto(self, b) -> int:
        data = self.read(len(b))
        b[:len(data)] = data
        return len(data)

    def close(self) -> None:
        if not self.closed:
            _close_quietly(self._raw)
            self._raw, self._buf = None, b""
        super().close()


def _seekable(raw) -> bool:
    try:
        return bool(raw.seekable())
    except Exception:  # noqa: BLE001
        return False


def _close_quietly(raw) -> None:
    if raw is None:
        return
    try:
        raw.close()
    except Exception:  # noqa: BLE001 (closing a broken connection may raise anything)
        pass


def open_shard(spec: str, retry: Retry = Retry()) -> BinaryIO:
    """A binary file over the shard's bytes: a plain file for a local path, else a
    ``ShardStream`` (raises ShardReadError when a remote shard cannot be opened)."""
    return ShardStream(spec, retry) if is_streamed(spec) else open(spec, "rb")


def read_small(spec: str, retry: Retry = Retry()) -> bytes | None:
    """All bytes of a small file (sizes.json, *_stats.json, classnames.txt) at a local path or
    URL; None when it does not exist. Other failures raise after the retries."""
    if not is_streamed(spec):
        if not os.path.isfile(spec):
            return None
        with open(spec, "rb") as f:
            return f.read()
    try:
        with ShardStream(spec, retry) as f:
            return f.read()
    except ShardReadError as e:
        if isinstance(e.__cause__, FileNotFoundError):
            return None
        raise


def read_many(urls: list[str]) -> dict[str, bytes | None]:
    """{url: bytes or None if missing} for many small remote files, fetched concurrently where
    the backend can (fsspec ``cat`` of a list: one batch of async requests for http/s3/gcs)."""
    out: dict[str, bytes | None] = {}
    if not urls:
        return out
    fs, _ = filesystem(urls[0])
    paths = [filesystem(u)[1] for u in urls]
    got = fs.cat(paths, on_error="return")
    for url, path in zip(urls, paths):
        value = got.get(path) if isinstance(got, dict) else got
        if isinstance(value, FileNotFoundError) or value is None:
            out[url] = None
        elif isinstance(value, BaseException):
            raise ShardReadError(f"{url}: {value}")
        else:
            out[url] = value
    return out
