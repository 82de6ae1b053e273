"""Run folders: one shim over fsspec for a local folder and a bucket (``s3://``, ``gs://``), so
the checkpointer, the logger and the study make the same calls for both (docs/checkpoints.md).

They differ in three facts, kept here: where a writer puts real files (``stage``, ``file``: beside
the target, or in this process's temp folder $TMPDIR/vlp-run-PID-*), how an object appears whole
(``put``: a rename, or one PUT: a store has no rename), and how a file is created only if absent
(``create``: O_EXCL, or a conditional PUT).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
import threading
from pathlib import Path
from typing import Callable, Optional

from vlp.locations import filesystem
from vlp.util import atomic_write, pid_alive

CACHE_PREFIX = "vlp-run-"  # $TMPDIR/vlp-run-PID-XXXX: a bucket folder's stage and downloads
SIDECAR = ".manifest.json"  # a single file's checksums beside it (vlp.checkpoint.integrity)


class StorageError(ValueError):
    """A run folder that cannot be used; the message is one line naming the URL and the cause."""


def remove_dead_caches() -> list[Path]:
    """Remove the temp folders (``CACHE_PREFIX``PID-*) of processes that no longer run."""
    removed = []
    for path in Path(tempfile.gettempdir()).glob(f"{CACHE_PREFIX}*-*"):
        pid = path.name[len(CACHE_PREFIX):].split("-", 1)[0]
        if path.is_dir() and pid.isdigit() and not pid_alive(int(pid)):
            shutil.rmtree(path, ignore_errors=True)
            removed.append(path)
    return removed


def remove_local(path: Path) -> None:
    """Delete a local file or folder; missing is fine."""
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)


class RunFolder:
    """A run's folder at a local path or URL; names are relative paths inside it. A bucket
    folder stages and downloads in ``cache_dir``, a temp folder that ``close`` removes."""

    def __init__(self, url_or_path, **storage_options):
        self.url = str(url_or_path).rstrip("/") or "/"
        try:
            self.fs, root = filesystem(self.url, **storage_options)
        except ImportError as e:
            raise StorageError(f"{self.url}: {e}") from None
        protocols = (self.fs.protocol,) if isinstance(self.fs.protocol, str) else tuple(self.fs.protocol)
        self.remote = "file" not in protocols  # not this machine's file system (a bucket, memory://)
        self.root = root.rstrip("/")
        self._cache: Optional[Path] = None
        self._thread: Optional[threading.Thread] = None
        self._publishing: Optional[Path] = None  # the local path of the put in flight
        self._error: Optional[BaseException] = None
        self._parent: Optional[RunFolder] = None

    def sub(self, name: str) -> "RunFolder":
        """The folder ``name`` inside this one, sharing its connection and temp folder."""
        sub = RunFolder.__new__(RunFolder)
        sub.__dict__.update(self.__dict__, url=self.path(name), root=self._key(name), _thread=None,
                            _error=None, _parent=self)
        return sub

    def path(self, name: str = "") -> str:
        """The URL (bucket) or path (local) of a member, for messages."""
        return f"{self.url}/{name}" if name else self.url

    def _key(self, name: str = "") -> str:
        return f"{self.root}/{name}".rstrip("/") if name else self.root

    @property
    def cache_dir(self) -> Path:
        """This process's temp folder ($TMPDIR/vlp-run-PID-*), made after removing dead ones'."""
        if self._parent is not None:
            return self._parent.cache_dir
        if self._cache is None:
            remove_dead_caches()
            self._cache = Path(tempfile.mkdtemp(prefix=f"{CACHE_PREFIX}{os.getpid()}-"))
        return self._cache

    def write_bytes(self, name: str, data: bytes) -> None:
        """Replace ``name``, readers seeing the old or the new bytes: one PUT, or temp + rename."""
        if self.remote:
            self.fs.pipe_file(self._key(name), data)
        else:
            atomic_write(self._key(name), data)

    def create(self, name: str, data: bytes) -> bool:
        """Create ``name`` holding ``data`` if absent, one creator winning (O_EXCL, or S3
        If-None-Match / GCS ifGenerationMatch=0); False when it exists."""
        try:
            if self.remote:
                self.fs.pipe_file(self._key(name), data, mode="create")
                return True
            Path(self._key(name)).parent.mkdir(parents=True, exist_ok=True)
            with open(self._key(name), "xb") as f:  # O_CREAT | O_EXCL
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            return True
        except FileExistsError:
            return False

    def read_bytes(self, name: str) -> bytes:
        try:
            return self.fs.cat_file(self._key(name))
        except (FileNotFoundError, IsADirectoryError):
            raise FileNotFoundError(f"{self.path(name)} does not exist") from None

    def exists(self, name: str = "") -> bool:
        return self.fs.exists(self._key(name))

    def listdir(self, name: str = "") -> list[str]:
        """Names of the entries directly under ``name``, sorted."""
        key = self._key(name)
        try:
            entries = self.fs.ls(key, detail=False, refresh=True)
        except (FileNotFoundError, NotADirectoryError):
            return []
        prefix = key.rstrip("/") + "/"
        return sorted({e.rstrip("/")[len(prefix):].split("/")[0] for e in entries if e.startswith(prefix)})

    def remove(self, name: str, tree: bool = False) -> None:
        """Delete a file, or with ``tree`` a folder and everything under it; missing is fine."""
        with contextlib.suppress(FileNotFoundError):
            self.fs.rm(self._key(name), recursive=tree)
        self.fs.invalidate_cache()

    def move(self, name: str, new: str) -> None:
        """Rename a file or folder (in a bucket: copy, then delete), replacing ``new``."""
        self.remove(new, tree=True)
        self.fs.mv(self._key(name), self._key(new), recursive=True)
        self.fs.invalidate_cache()

    def stage(self, name: str, tag: str = "") -> Path:
        """A fresh local path to write ``name`` to before ``put``: ``.BASE.tmp-PID[-TAG]`` beside
        it (a killed writer's is known by its PID), or in this process's temp folder."""
        parent, _, base = name.rpartition("/")
        temp = f".{base}.tmp-{os.getpid()}" + (f"-{tag}" if tag else "")
        path = (self.cache_dir / "stage" / parent if self.remote else Path(self._key(parent))) / temp
        if self._publishing == path:  # the same name again: its previous copy is still being put
            self.wait()
        if path.is_dir():  # a file is truncated by its writer
            remove_local(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        return path

    def put(self, local, name: str, keep: bool = False) -> None:
        """The file ``local``, or each file under the folder ``local``, as ``name`` (plus its
        relative name), each appearing whole; ``local`` goes unless ``keep``."""
        local = Path(local)
        files = [("", local)] if local.is_file() else sorted(
            (p.relative_to(local).as_posix(), p) for p in local.rglob("*") if p.is_file())
        for rel, path in files:
            key = self._key(f"{name}/{rel}".strip("/") if rel else name)
            if self.remote:
                self.fs.put_file(str(path), key)
            elif Path(key) != path:
                Path(key).parent.mkdir(parents=True, exist_ok=True)
                shutil.copyfile(path, key) if keep else os.replace(path, key)
        if not keep:
            remove_local(local)
        self.fs.invalidate_cache()

    def publish(self, local, name: str, then: Optional[Callable[[], None]] = None) -> None:
        """``put`` in the background, then ``then()``; waits for the previous one first."""
        self.wait()

        def run():
            try:
                self.put(local, name)
                if then is not None:
                    then()
            except BaseException as e:  # noqa: BLE001 (raised in the caller's thread by wait())
                self._error = e

        self._publishing = Path(local)
        self._thread = threading.Thread(target=run, name=f"vlp-publish-{name}", daemon=True)
        self._thread.start()

    def wait(self) -> None:
        """Block until the background upload is done; raise its error in one line."""
        if self._thread is not None:
            self._thread.join()
            self._thread, self._publishing = None, None
        if self._error is not None:
            error, self._error = self._error, None
            raise StorageError(f"uploading a checkpoint to {self.url} failed: {_cause(error)}") from error

    def download(self, name: str) -> Path:
        """A local path holding ``name`` (file or folder): itself, or a copy in the temp folder."""
        key = self._key(name)
        files = self.fs.find(key) if self.remote else [key] * os.path.exists(key)
        if not files:
            raise FileNotFoundError(f"{self.path(name)} does not exist")
        if not self.remote:
            return Path(key)
        dest = self.cache_dir / "downloads" / name
        remove_local(dest)
        for f in files:
            target = dest / f[len(key):].lstrip("/")
            target.parent.mkdir(parents=True, exist_ok=True)
            self.fs.get_file(f, str(target))
        return dest

    def drop_downloads(self) -> None:
        cache = (self._parent or self)._cache
        if self.remote and cache is not None:
            remove_local(cache / "downloads")

    @classmethod
    def of(cls, url_or_path, **kwargs) -> tuple["RunFolder", str]:
        """(folder, name) of one file's URL or path: its parent folder and its base name."""
        parent, slash, base = str(url_or_path).rstrip("/").rpartition("/")
        return cls(parent if slash else ".", **kwargs), base

    def local_dir(self, name: str) -> Path:
        """A local folder for tools that write files (tb/, eval reports): itself, or a temp
        folder that ``sync_dir`` uploads."""
        path = self.cache_dir / "dirs" / name if self.remote else Path(self._key(name))
        path.mkdir(parents=True, exist_ok=True)
        return path

    def sync_dir(self, name: str) -> None:
        if self.remote:
            self.put(self.local_dir(name), name, keep=True)

    @contextlib.contextmanager
    def file(self, name: str):
        """A local path to write ``name`` to: itself, or a temp file uploaded when the block ends
        without an error, then its sidecar NAME.manifest.json if written."""
        path = self.cache_dir / "files" / name if self.remote else Path(self._key(name))
        path.parent.mkdir(parents=True, exist_ok=True)
        yield path
        for local, member in ((path, name), (path.with_name(path.name + SIDECAR), name + SIDECAR)):
            if self.remote and local.is_file():  # the file first: a manifest is never without it
                self.fs.put_file(str(local), self._key(member))

    def close(self) -> None:
        """Finish the upload in flight (raising its error) and remove the temp folder."""
        try:
            self.wait()
        finally:
            if self._parent is None and self._cache is not None:
                shutil.rmtree(self._cache, ignore_errors=True)
                self._cache = None


# ---------------------------------------------------------------------- start-up check
def _cause(error: BaseException) -> str:
    """The cause of a storage failure in a few words, one line."""
    text = " ".join(str(error).split()) or type(error).__name__
    if isinstance(error, PermissionError) or any(w in text for w in (
            "AccessDenied", "InvalidAccessKeyId", "SignatureDoesNotMatch", " 401", " 403")):
        return f"access denied (check the credentials): {text}"
    if isinstance(error, FileNotFoundError):
        return f"not found: {text}"
    return f"{type(error).__name__}: {text}"


def open_run_folder(url_or_path, option: str = "train.output_dir") -> RunFolder:
    """The RunFolder of a run's output; a bucket is checked first (its backend installed, then
    `check_writable`: one line naming ``option`` before anything is written). A local path is
    not touched here."""
    try:
        folder = RunFolder(url_or_path)
    except StorageError as e:  # no backend for the URL's scheme
        raise StorageError(f"{option}={e}") from None
    if folder.remote:
        check_writable(folder.url, option=option)
        remove_dead_caches()  # stage copies and downloads of runs that were killed
    return folder


def _probe(url: str, probe: str) -> str:
    """Write, read back and delete a probe object; '' when that worked, else the cause."""
    try:
        folder = RunFolder(url, skip_instance_cache=True)
        try:
            folder.write_bytes(probe, b"ok")
        except FileNotFoundError:
            return f"bucket {folder.root.split('/', 1)[0]!r} does not exist"
        if folder.read_bytes(probe) != b"ok":
            return "a probe object read back different bytes"
        folder.remove(probe)
        return ""
    except BaseException as e:  # noqa: BLE001
        return _cause(e)


def check_writable(url, timeout_s: Optional[float] = None, option: str = "train.output_dir") -> None:
    """Check at start that a run folder in a bucket can be written (a probe written, read back,
    deleted), or StorageError in one line naming the URL and the cause; the probe runs in a thread
    so the backend's retries cannot stretch ``timeout_s`` ($VLP_STORAGE_TIMEOUT_S, else 30 s)."""
    url = str(url).rstrip("/")
    timeout_s = float(os.environ.get("VLP_STORAGE_TIMEOUT_S", 30)) if timeout_s is None else timeout_s
    probe = f".vlp-write-check-{os.uname().nodename}-{os.getpid()}"
    outcome: list[str] = []
    thread = threading.Thread(target=lambda: outcome.append(_probe(url, probe)), daemon=True)
    thread.start()
    thread.join(timeout_s)
    if not outcome:
        raise StorageError(f"{option}={url}: no answer from the storage endpoint within {timeout_s:g} s "
                           f"(unreachable endpoint or network?)")
    if outcome[0]:
        raise StorageError(f"{option}={url}: cannot write there: {outcome[0]}")
