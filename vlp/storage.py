"""Run folders on a local disk or in a bucket (``s3://``, ``gs://``, any fsspec URL).

    folder = RunFolder("s3://bucket/runs/x")        # or a plain path: plain local files
    check_writable(folder.url)                      # at start: one clear line if it cannot work
    folder.write_text("config.yaml", text)
    log = folder.log_writer("log.jsonl")            # appends; on a bucket uploaded every 30 s
    stage = folder.stage_dir()                      # save a checkpoint locally ...
    torch.save(state, stage / "step_00000007.pt")
    folder.publish(stage / "step_00000007.pt", "checkpoints/step_00000007.pt")  # ... upload in the background
    folder.wait()                                   # before the next publish and at exit
    names = folder.committed_checkpoints()          # ['checkpoints/step_00000007.pt', ...]
    path = folder.fetch(names[-1])                  # a local file (or folder) to torch.load

Object stores have no rename and no append, so a bucket folder keeps two rules:

* **A checkpoint is committed by its manifest.** ``publish`` uploads every object of the
  checkpoint (one file, or a DCP directory's files), then writes ``NAME.manifest.json`` last:
  the list of objects with their sizes and SHA-256. ``committed_checkpoints`` lists only names
  with a manifest, so an upload killed halfway is never resumed from; ``fetch`` checks every
  object against it (a truncated or swapped object is an ``IntegrityError``); ``prune`` and
  ``set_aside`` remove the manifest first, so a checkpoint being deleted is never half-listed.
  A local folder keeps today's rule instead: stage beside the final name, then one rename.
* **Whole objects only.** ``write_*`` replaces an object in one PUT (readers see the old or the
  new one); ``log_writer`` keeps the log in a local file and uploads it whole, periodically and
  at close (an object cannot be appended to; a crash loses at most the last interval).

One writer per run folder (DESIGN.md §6): the trainer's lock object is vlp.train.runlock.acquire_bucket
(create-if-absent). The trainer's parts use this module (vlp.train.manager, logger, evaluator), so
``train.output_dir=s3://...`` gets a local run folder's files; ``open_run_folder`` checks it at start.
Uploads go through one background thread; its error is raised by the next ``wait``/``publish``.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import tempfile
import threading
import time
from pathlib import Path
from typing import Optional, Sequence

from vlp.config import ConfigError
from vlp.integrity import IntegrityError, file_digest
from vlp.util import atomic_write, pid_alive

MANIFEST = ".manifest.json"  # suffix of a checkpoint's commit marker
CACHE_PREFIX = "vlp-run-"  # $TMPDIR/vlp-run-PID-XXXX: a bucket folder's stage and downloads
CHECKPOINT_RE = re.compile(r"^step_(\d+)(\.pt)?$")  # vlp's names: step_N.pt (one file), step_N/ (DCP)
_SCHEME = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*://")
_EXTRAS = {"s3": "vlp[s3]", "s3a": "vlp[s3]", "gs": "vlp[gcs]", "gcs": "vlp[gcs]"}


def is_url(path) -> bool:
    """A URL with a scheme ('s3://b/k', 'gs://b/k', 'file:///d'); a plain path is not."""
    return bool(_SCHEME.match(str(path)))


class StorageError(ConfigError):
    """A run folder that cannot be used; the message is one line naming the URL and the cause."""


def remove_dead_caches(root: Optional[Path] = None) -> list[Path]:
    """Remove the temp folders (``CACHE_PREFIX``PID-*) of processes that no longer run."""
    removed = []
    for path in Path(root or tempfile.gettempdir()).glob(f"{CACHE_PREFIX}*-*"):
        pid = path.name[len(CACHE_PREFIX):].split("-", 1)[0]
        if path.is_dir() and pid.isdigit() and not pid_alive(int(pid)):
            shutil.rmtree(path, ignore_errors=True)
            removed.append(path)
    return removed


def _files_under(local: Path) -> list[tuple[str, Path]]:
    """(relative name, path) of a file, or of every file under a folder, sorted."""
    if local.is_file():
        return [("", local)]
    return sorted((p.relative_to(local).as_posix(), p) for p in local.rglob("*") if p.is_file())


def _remove_staged(local_path: Path) -> None:
    """Delete a published checkpoint's local copy, and its stage folder when that is all it held."""
    if local_path.is_dir():
        shutil.rmtree(local_path, ignore_errors=True)
    elif local_path.exists():
        local_path.unlink()
    stage = local_path.parent
    if stage.name.startswith(("stage-", ".stage-")) and stage.is_dir() and not any(stage.iterdir()):
        stage.rmdir()


def companion(name: str) -> str:
    """The per-rank folder saved beside checkpoint ``name``: step_N.pt or step_N -> step_N.ranks."""
    return name.removesuffix(".pt") + ".ranks"


def _step_key(name: str):
    m = CHECKPOINT_RE.match(name.rstrip("/").rsplit("/", 1)[-1])
    return (0, int(m.group(1)), name) if m else (1, 0, name)


class RunFolder:
    """A run's output folder at a local path or URL (module docstring). Names are relative
    paths inside it ('log.jsonl', 'checkpoints/step_00000007.pt').

    ``cache_dir``: where a bucket folder stages checkpoints and keeps fetched ones (default: a
    temp folder removed by ``close``). ``storage_options``: passed to fsspec (endpoint, keys)."""

    def __init__(self, url_or_path, cache_dir: Optional[str] = None, **storage_options):
        self.url = str(url_or_path).rstrip("/")
        self.remote = is_url(self.url) and not self.url.startswith("file://")
        self._own_cache = cache_dir is None
        self._cache = Path(cache_dir) if cache_dir else None
        self._thread: Optional[threading.Thread] = None
        self._error: Optional[BaseException] = None
        self._stages = 0
        if self.remote:
            import fsspec

            try:
                self.fs, self.root = fsspec.core.url_to_fs(self.url, **storage_options)
            except ImportError:
                raise StorageError(_missing_backend(self.url)) from None
            self.root = self.root.rstrip("/")
        else:
            self.fs = None
            self.root = self.url.removeprefix("file://")

    # ------------------------------------------------------------------ paths
    def path(self, name: str = "") -> str:
        """The full URL (bucket) or path (local) of a member."""
        return f"{self.url}/{name}".rstrip("/") if name else self.url

    def _key(self, name: str) -> str:  # bucket key (no scheme) of a member
        return f"{self.root}/{name}".rstrip("/") if name else self.root

    def _local(self, name: str) -> Path:
        return Path(self.root, name)

    @property
    def cache_dir(self) -> Path:
        """This process's temp folder ($TMPDIR/vlp-run-PID-*): staged checkpoints, downloads.
        Removed by ``close``; those of dead processes (a SIGKILL) when the next one is made."""
        if self._cache is None:
            remove_dead_caches()
            self._cache = Path(tempfile.mkdtemp(prefix=f"{CACHE_PREFIX}{os.getpid()}-"))
        self._cache.mkdir(parents=True, exist_ok=True)
        return self._cache

    # ------------------------------------------------------------------ whole objects
    def write_bytes(self, name: str, data: bytes) -> None:
        """Replace ``name`` with ``data``: one PUT on a bucket, temp + rename locally."""
        if self.remote:
            self.fs.pipe_file(self._key(name), data)
        else:
            atomic_write(self._local(name), data)

    def write_text(self, name: str, text: str) -> None:
        self.write_bytes(name, text.encode("utf-8"))

    def read_bytes(self, name: str) -> bytes:
        """The bytes of ``name``; FileNotFoundError naming its URL when it does not exist."""
        try:
            if self.remote:
                return self.fs.cat_file(self._key(name))
            return self._local(name).read_bytes()
        except FileNotFoundError:
            raise FileNotFoundError(f"{self.path(name)} does not exist") from None

    def read_text(self, name: str) -> str:
        return self.read_bytes(name).decode("utf-8")

    def exists(self, name: str = "") -> bool:
        if self.remote:
            return self.fs.exists(self._key(name))
        return self._local(name).exists()

    def listdir(self, name: str = "") -> list[str]:
        """Names of the entries directly under ``name`` (files and folders), sorted; [] when
        there is none (a bucket has no empty folders)."""
        if not self.remote:
            d = self._local(name)
            return sorted(p.name for p in d.iterdir()) if d.is_dir() else []
        try:
            entries = self.fs.ls(self._key(name), detail=False, refresh=True)
        except FileNotFoundError:
            return []
        prefix = self._key(name) + "/"
        return sorted({e.rstrip("/")[len(prefix):].split("/")[0] for e in entries if e.startswith(prefix)})

    def remove(self, name: str, tree: bool = False) -> None:
        """Delete a file, or with ``tree`` a folder and everything under it; missing is fine."""
        if self.remote:
            key = self._key(name)
            try:
                if tree:
                    files = self.fs.find(key)
                    if files:
                        self.fs.rm(files)
                else:
                    self.fs.rm_file(key)
            except FileNotFoundError:
                pass
            self.fs.invalidate_cache()
            return
        path = self._local(name)
        if tree and path.is_dir():
            shutil.rmtree(path, ignore_errors=True)
        else:
            path.unlink(missing_ok=True)

    def upload(self, local_path, name: str) -> None:
        """Copy a local file or folder to ``name`` now (eval reports, a finished tb/ folder)."""
        local_path = Path(local_path)
        if not self.remote:
            dest = self._local(name)
            if local_path.is_dir():
                shutil.copytree(local_path, dest, dirs_exist_ok=True)
            else:
                dest.parent.mkdir(parents=True, exist_ok=True)
                shutil.copyfile(local_path, dest)
            return
        for rel, path in _files_under(local_path):
            self.fs.put_file(str(path), self._key(f"{name}/{rel}".strip("/") if rel else name))

    def download(self, name: str) -> Path:
        """A local path holding the plain object ``name`` (no manifest: open_clip_model.pt, a
        config): the file itself in a local folder, else a copy in the cache folder."""
        if not self.remote:
            path = self._local(name)
            if not path.is_file():
                raise FileNotFoundError(f"{path} does not exist")
            return path
        dest = self.cache_dir / "downloads" / name
        dest.parent.mkdir(parents=True, exist_ok=True)
        try:
            self.fs.get_file(self._key(name), str(dest))
        except FileNotFoundError:
            raise FileNotFoundError(f"{self.path(name)} does not exist") from None
        return dest

    @classmethod
    def of(cls, url_or_path, **kwargs) -> tuple["RunFolder", str]:
        """(folder, name) for one file's URL or path: ``RunFolder.of("s3://b/runs/x/checkpoints/
        step_00000100.pt")`` is (RunFolder("s3://b/runs/x"), "checkpoints/step_00000100.pt")
        when the parent is a checkpoints/ folder, else (its parent folder, its base name)."""
        text = str(url_or_path).rstrip("/")
        parent, base = text.rsplit("/", 1) if "/" in text else (".", text)
        if parent.endswith("/checkpoints") or parent == "checkpoints":
            root = parent[:-len("checkpoints")].rstrip("/") or "."
            return cls(root, **kwargs), f"checkpoints/{base}"
        return cls(parent, **kwargs), base

    def local_dir(self, name: str) -> Path:
        """A real local folder for ``name``, for tools that write files themselves
        (tensorboard's tb/, eval reports): the folder itself when local; on a bucket a cache
        folder, which ``sync_dir(name)`` uploads."""
        path = self._local(name) if not self.remote else self.cache_dir / "dirs" / name
        path.mkdir(parents=True, exist_ok=True)
        return path

    def sync_dir(self, name: str) -> None:
        """Upload what ``local_dir(name)`` holds now (bucket; a no-op locally)."""
        if self.remote:
            self.upload(self.local_dir(name), name)

    @contextlib.contextmanager
    def file(self, name: str, sidecar: bool = False):
        """A local path to write member ``name`` to, for tools that take a path
        (``torch.save``, ``write_text``): the member itself in a local folder; on a bucket a
        cache file uploaded whole when the block ends without an error. ``sidecar``: also
        upload ``NAME.manifest.json`` written beside it (its checksums, vlp.integrity).

            with folder.file("result.json") as path:
                path.write_text(text)"""
        if not self.remote:
            self._local(name).parent.mkdir(parents=True, exist_ok=True)
            yield self._local(name)
            return
        path = self.cache_dir / "files" / name
        path.parent.mkdir(parents=True, exist_ok=True)
        yield path
        self.fs.put_file(str(path), self._key(name))
        side = path.with_name(path.name + MANIFEST)
        if sidecar and side.is_file():  # after the file: a reader never finds a manifest without it
            self.fs.put_file(str(side), self._key(name + MANIFEST))

    def log_writer(self, name: str = "log.jsonl", upload_every_s: float = 30.0) -> "LogWriter":
        return LogWriter(self, name, upload_every_s)

    # ------------------------------------------------------------------ checkpoints
    def stage_dir(self) -> Path:
        """A fresh local folder to save a checkpoint into before ``publish``. Locally it is
        inside the run folder (``.stage-PID-N``: the same disk, so publishing is a rename)."""
        self._stages += 1
        if self.remote:
            path = self.cache_dir / f"stage-{os.getpid()}-{self._stages}"
        else:
            path = self._local(f".stage-{os.getpid()}-{self._stages}")
        if path.exists():
            shutil.rmtree(path)
        path.mkdir(parents=True)
        return path

    def publish(self, local_path, name: str, keep_last: Optional[int] = None, remove_local: bool = True,
                before: Sequence[tuple] = ()) -> None:
        """Make the checkpoint at ``local_path`` (a file or a folder) the committed ``name``.
        Locally: one rename, done on return. On a bucket: waits for the previous upload, then
        uploads in a background thread, every object first and the manifest last (``wait``).
        ``keep_last``: then prune to that many (in the background too: no bucket round trip
        in the training loop). ``remove_local``: delete the staged copy once it is uploaded.
        ``before``: (local path, name) pairs published (committed) first, in the same upload:
        companions the checkpoint needs (its per-rank files ``step_N.ranks/``)."""
        self.wait()
        local_path = Path(local_path)
        if not local_path.exists():
            raise FileNotFoundError(f"nothing to publish at {local_path}")
        if not self.remote:
            for local, member in [*before, (local_path, name)]:
                dest = self._local(member)
                dest.parent.mkdir(parents=True, exist_ok=True)
                if dest.is_dir():  # the same step saved again
                    shutil.rmtree(dest)
                os.replace(local, dest)
                _remove_staged(Path(local))
            if keep_last is not None:
                self.prune(keep_last, name.rsplit("/", 1)[0] if "/" in name else "")
            return
        pairs = [(Path(p), n) for p, n in before] + [(local_path, name)]
        self._thread = threading.Thread(target=self._upload_checkpoint, args=(pairs, name, keep_last, remove_local),
                                        name=f"vlp-publish-{name}", daemon=True)
        self._thread.start()

    def _upload_checkpoint(self, pairs: list, name: str, keep_last, remove_local: bool) -> None:
        try:
            self.discard(name)  # the same name published again: never half old, half new
            for local_path, member in pairs:  # the companions first, the checkpoint last
                if member != name:
                    self.discard(member)
                objects = self.upload_part(local_path, member)
                self.commit(member, objects, "dir" if local_path.is_dir() else "file")
            if remove_local:
                for local_path, _ in pairs:
                    _remove_staged(local_path)
            if keep_last is not None:
                self.prune(keep_last, name.rsplit("/", 1)[0] if "/" in name else "")
        except BaseException as e:  # noqa: BLE001 (raised in the trainer's thread by wait())
            self._error = e

    # The three steps of publish, for a checkpoint written by several processes (DCP under FSDP:
    # each rank holds its own shard files). Every rank stages its files locally and
    #     rank 0: discard(name); barrier
    #     every rank: entries = upload_part(stage / "step_N", name); gathered to rank 0
    #     rank 0: commit(name, all ranks' entries)   (the manifest: written last)
    # A rank that dies before the commit leaves objects that are never listed.
    def discard(self, name: str) -> None:
        """Uncommit and delete checkpoint ``name`` (manifest first); missing is fine."""
        self._remove_checkpoint(name)

    def upload_part(self, local_path, name: str) -> list[dict]:
        """Upload the files of ``local_path`` (a file, or the files under a folder) to
        ``name`` and return their manifest entries (name, bytes, sha256); commits nothing."""
        objects = []
        for rel, path in _files_under(Path(local_path)):
            if self.remote:
                self.fs.put_file(str(path), self._key(f"{name}/{rel}" if rel else name))
            else:
                dest = self._local(f"{name}/{rel}" if rel else name)
                dest.parent.mkdir(parents=True, exist_ok=True)
                shutil.copyfile(path, dest)
            objects.append({"name": rel, "bytes": path.stat().st_size, "sha256": file_digest(path)})
        return objects

    def commit(self, name: str, objects: list[dict], kind: str = "dir") -> None:
        """Write the manifest of ``name`` listing ``objects`` (upload_part's entries, all
        ranks'): from here on it is listed. Raises if an entry has no uploaded object."""
        if not self.remote:
            return  # a local folder commits by rename (publish); a local DCP folder is shared
        names = [o["name"] for o in objects]
        if len(set(names)) != len(names):
            raise ValueError(f"checkpoint {self.path(name)}: an object is listed twice in the manifest")
        present = set(self.fs.find(self._key(name))) if kind == "dir" else {self._key(name)}
        missing = [n for n in names if self._key(f"{name}/{n}" if n else name) not in present]
        if missing:
            raise IntegrityError(f"checkpoint {self.path(name)} cannot be committed: {missing[0]} was not uploaded")
        manifest = {"name": name, "kind": kind, "objects": sorted(objects, key=lambda o: o["name"]),
                    "written_at": time.time()}
        self.fs.pipe_file(self._key(name + MANIFEST), json.dumps(manifest, indent=1).encode())  # the commit
        self.fs.invalidate_cache()

    def wait(self) -> None:
        """Block until the background upload is done; raise its error (one line) if it failed."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self._error is not None:
            error, self._error = self._error, None
            raise StorageError(f"uploading a checkpoint to {self.url} failed: {_cause(error)}") from error

    @property
    def uploading(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def committed_checkpoints(self, directory: str = "checkpoints", pattern=CHECKPOINT_RE) -> list[str]:
        """Names ('checkpoints/step_N.pt') of the committed checkpoints under ``directory``
        whose base name matches ``pattern``, oldest step first. Bucket: those with a manifest.
        Local: those under their final name (not stage folders, temp files or ``.corrupt``)."""
        names = []
        for entry in self.listdir(directory):
            if self.remote:
                if not entry.endswith(MANIFEST):
                    continue
                entry = entry[:-len(MANIFEST)]
            if re.match(pattern, entry):
                names.append(f"{directory}/{entry}")
        return sorted(names, key=_step_key)

    def manifest(self, name: str) -> dict:
        return json.loads(self.read_bytes(name + MANIFEST))

    def fetch(self, name: str) -> Path:
        """A local path holding checkpoint ``name`` for loading: the file itself in a local
        folder; from a bucket, a download into the cache folder checked against the manifest
        (IntegrityError for a size or SHA-256 mismatch, FileNotFoundError if not committed)."""
        if not self.remote:
            path = self._local(name)
            if not path.exists():
                raise FileNotFoundError(f"checkpoint not found: {path}")
            return path
        try:
            manifest = self.manifest(name)
        except FileNotFoundError:
            raise FileNotFoundError(f"checkpoint not found: {self.path(name)} (no committed manifest)") from None
        dest = self.cache_dir / "fetched" / name
        if dest.exists():
            shutil.rmtree(dest) if dest.is_dir() else dest.unlink()
        dest.parent.mkdir(parents=True, exist_ok=True)
        for obj in manifest["objects"]:
            rel = obj["name"]
            target = dest / rel if rel else dest
            target.parent.mkdir(parents=True, exist_ok=True)
            try:
                self.fs.get_file(self._key(f"{name}/{rel}" if rel else name), str(target))
            except FileNotFoundError:
                raise IntegrityError(f"checkpoint {self.path(name)} is incomplete: "
                                     f"{rel or 'its file'} is missing") from None
            size, digest = target.stat().st_size, file_digest(target)
            if size != obj["bytes"] or digest != obj["sha256"]:
                raise IntegrityError(f"checkpoint {self.path(name)} does not match its manifest: "
                                     f"{rel or 'its file'} has {size} bytes / sha256 {digest[:12]}, "
                                     f"expected {obj['bytes']} / {obj['sha256'][:12]}")
        return dest

    def _remove_checkpoint(self, name: str) -> None:
        if self.remote:
            self.remove(name + MANIFEST)  # first: from here on it is not listed
        self.remove(name, tree=True)

    def prune(self, keep_last: int, directory: str = "checkpoints") -> list[str]:
        """Delete all but the newest ``keep_last`` committed checkpoints; the names deleted.
        An upload in flight is not committed yet, so it is not counted: the last ``keep_last``
        committed ones stay until it is (never fewer valid checkpoints than asked for)."""
        names = self.committed_checkpoints(directory)
        old = names[:-keep_last] if keep_last > 0 else []
        for name in old:
            self._remove_checkpoint(name)
            self._remove_checkpoint(companion(name))  # its per-rank files, when it has them
        return old

    def set_aside(self, name: str) -> str:
        """Take a bad checkpoint out of ``committed_checkpoints`` but keep its bytes for
        inspection: locally renamed to NAME.corrupt; on a bucket its manifest becomes
        NAME.corrupt.json (the objects stay). Returns the new name."""
        if not self.remote:
            os.replace(self._local(name), self._local(name + ".corrupt"))
            return name + ".corrupt"
        data = self.read_bytes(name + MANIFEST)
        self.write_bytes(name + ".corrupt.json", data)
        self.remove(name + MANIFEST)
        return name + ".corrupt.json"

    def remove_uncommitted(self, directory: str = "checkpoints") -> list[str]:
        """At start (one writer): delete what killed saves left. Bucket: objects under
        ``directory`` that belong to no manifest (an upload stopped halfway). Local: stage
        folders of dead processes. Returns what was removed. Waits for this process's own
        upload in flight first (its objects have no manifest yet)."""
        self.wait()
        removed = []
        if not self.remote:
            root = Path(self.root)
            for stage in sorted(root.glob(".stage-*-*")) if root.is_dir() else []:
                if stage.is_dir() and not pid_alive(int(stage.name.split("-")[1])):
                    shutil.rmtree(stage, ignore_errors=True)
                    removed.append(stage.name)
            return removed
        listed = self.listdir(directory)
        committed = {e[:-len(MANIFEST)] for e in listed if e.endswith(MANIFEST)}
        for base in sorted(c for c in committed if c.endswith(".ranks")):  # per-rank files of no checkpoint
            if not committed & {base.removesuffix(".ranks"), base.removesuffix(".ranks") + ".pt"}:
                self._remove_checkpoint(f"{directory}/{base}")
                committed.discard(base)
                removed.append(f"{directory}/{base}")
        listed = self.listdir(directory)
        for entry in listed:
            if entry.endswith(MANIFEST) or entry.endswith(".corrupt.json"):
                continue
            base = entry
            if base not in committed and not (self.exists(f"{directory}/{base}.corrupt.json")):
                self.remove(f"{directory}/{base}", tree=True)
                removed.append(f"{directory}/{base}")
        return removed

    def close(self) -> None:
        """Finish the upload in flight (raising its error) and remove the temp cache folder."""
        try:
            self.wait()
        finally:
            if self._own_cache and self._cache is not None:
                shutil.rmtree(self._cache, ignore_errors=True)
                self._cache = None


class LogWriter:
    """An appending text log (``log.jsonl``) in a run folder. Locally: a file opened for
    append, flushed on every line. On a bucket: lines go to a local copy (started from the
    existing object, so a resumed run keeps its history) that is uploaded whole when
    ``upload_every_s`` has passed since the last upload, on ``flush()`` and on ``close()``."""

    def __init__(self, folder: RunFolder, name: str, upload_every_s: float = 30.0):
        self.folder, self.name, self.upload_every_s = folder, name, upload_every_s
        self._last_upload = time.monotonic()
        if folder.remote:
            self._local = folder.cache_dir / "logs" / name
            self._local.parent.mkdir(parents=True, exist_ok=True)
            try:
                self._local.write_bytes(folder.read_bytes(name))
            except FileNotFoundError:
                self._local.write_bytes(b"")
        else:
            self._local = folder._local(name)
            self._local.parent.mkdir(parents=True, exist_ok=True)
        self._file = open(self._local, "a")
        self._dirty = False

    def write(self, line: str) -> None:
        """Append one line (a newline is added when missing)."""
        self._file.write(line if line.endswith("\n") else line + "\n")
        self._file.flush()
        self._dirty = True
        if self.folder.remote and time.monotonic() - self._last_upload >= self.upload_every_s:
            self.flush()

    def flush(self) -> None:
        """Upload the whole log now (bucket); a no-op locally."""
        self._file.flush()
        if self.folder.remote and self._dirty:
            self.folder.fs.put_file(str(self._local), self.folder._key(self.name))
            self._dirty = False
        self._last_upload = time.monotonic()

    def close(self) -> None:
        if not self._file.closed:
            self.flush()
            self._file.close()


# ---------------------------------------------------------------------- start-up check
def _missing_backend(url: str) -> str:
    scheme = url.split("://", 1)[0]
    extra = _EXTRAS.get(scheme)
    hint = f"pip install '{extra}'" if extra else f"install the fsspec backend for {scheme}://"
    return f"{url}: no storage backend for {scheme}:// is installed ({hint})"


def _cause(error: BaseException) -> str:
    """The cause of a storage failure in a few words, one line."""
    text = " ".join(str(error).split()) or type(error).__name__
    if isinstance(error, PermissionError) or "AccessDenied" in text or "InvalidAccessKeyId" in text \
            or "SignatureDoesNotMatch" in text or " 401" in text or " 403" in text:
        return f"access denied (check the credentials): {text}"
    if isinstance(error, FileNotFoundError):
        return f"not found: {text}"
    return f"{type(error).__name__}: {text}"


def open_run_folder(url_or_path, option: str = "train.output_dir") -> RunFolder:
    """The RunFolder of a run's output; a bucket is checked first (`check_writable`), so a
    wrong bucket, refused credentials, an unreachable endpoint or a missing extra fail in one
    line naming ``option`` before anything is written. A local path is not touched here."""
    if is_url(url_or_path) and not str(url_or_path).startswith("file://"):
        check_writable(url_or_path, option=option)
        remove_dead_caches()  # stage copies and downloads of runs that were killed
    return RunFolder(url_or_path)


def check_writable(url, timeout_s: Optional[float] = None, option: str = "train.output_dir") -> None:
    """Check at start that a run folder can be written: write, read back and delete a small
    probe object. Raises StorageError with one line naming the URL and the cause: a missing
    backend (which extra to install), a bucket that does not exist, refused credentials, an
    endpoint that does not answer within ``timeout_s`` (default: $VLP_STORAGE_TIMEOUT_S, else
    30 s; the probe runs in a thread, so the
    backend's own retries cannot stretch it), or a local folder that cannot be created."""
    url = str(url).rstrip("/")
    timeout_s = float(os.environ.get("VLP_STORAGE_TIMEOUT_S", 30)) if timeout_s is None else timeout_s
    probe = f".vlp-write-check-{os.uname().nodename}-{os.getpid()}"
    if not is_url(url) or url.startswith("file://"):
        root = Path(url.removeprefix("file://"))
        try:
            root.mkdir(parents=True, exist_ok=True)
            (root / probe).write_bytes(b"ok")
            (root / probe).unlink()
        except OSError as e:
            raise StorageError(f"{option}={url}: cannot write there: {e.strerror or e}") from None
        return
    from vlp.data.shard_io import has_backend

    if not has_backend(url):
        raise StorageError(f"{option}={url}: {_missing_backend(url).split(': ', 1)[1]}")
    outcome: dict = {}

    def attempt():
        try:
            import fsspec

            fs, root = fsspec.core.url_to_fs(url, skip_instance_cache=True)
            bucket = root.split("/", 1)[0]
            key = f"{root.rstrip('/')}/{probe}"
            try:
                fs.pipe_file(key, b"ok")
            except FileNotFoundError:
                outcome["error"] = f"bucket {bucket!r} does not exist"
                return
            if fs.cat_file(key) != b"ok":
                outcome["error"] = "a probe object read back different bytes"
                return
            fs.rm_file(key)
            outcome["ok"] = True
        except BaseException as e:  # noqa: BLE001
            outcome["error"] = _cause(e)

    thread = threading.Thread(target=attempt, name="vlp-check-writable", daemon=True)
    thread.start()
    thread.join(timeout_s)
    if thread.is_alive():
        raise StorageError(f"{option}={url}: no answer from the storage endpoint within {timeout_s:g} s "
                           f"(unreachable endpoint or network?)")
    if "ok" not in outcome:
        raise StorageError(f"{option}={url}: cannot write there: {outcome['error']}")
