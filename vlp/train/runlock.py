"""One writer per run folder: `train.output_dir/vlp.lock`, created atomically by the main process.

    lock = acquire(out_dir, break_lock=cfg.train.break_lock, log=print)   # before anything is written
    ...
    lock.release()                                                          # also at exit, on errors

The lock file is created with O_CREAT|O_EXCL (exactly one creator wins, also on NFSv3+ and every
current NFS/Lustre/GPFS client; not on NFSv2) and holds the holder's pid, host, start time and
the pid's own start time (a reused pid is not mistaken for the holder). A second trainer on the
same folder is refused in one line naming the holder. A lock whose holder is gone (same host,
the pid no longer runs, or runs a process started later) is stale: reported in one line and
taken over. A lock from another host cannot be probed from here: refused, with the advice to set
train.break_lock=true once that run is known to be gone. A run folder in a bucket gets the same
rules with a lock object created if absent (`acquire_bucket`; S3 and GCS conditional writes).

Takeover is race-free: the stale file is renamed to a private name (only one process can rename
a given file), re-read, and put back (link, exclusive) if it turned out to be a fresh lock.
"""

from __future__ import annotations

import atexit
import datetime
import json
import os
import socket
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

LOCK_NAME = "vlp.lock"


class RunLockError(ValueError):
    """The run folder is held by another writer; the message is one line for the user."""


def _proc_start(pid: int) -> Optional[str]:
    """The kernel's start time of `pid` (clock ticks since boot; Linux), None where unknown."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
        return stat.rsplit(")", 1)[1].split()[19]  # field 22 counted from the pid
    except (OSError, IndexError):
        return None


def _holder_alive(holder: dict) -> bool:
    from vlp.util import pid_alive

    pid = holder.get("pid")
    if not isinstance(pid, int) or not pid_alive(pid):
        return False
    started, now = holder.get("pid_start"), _proc_start(pid)
    return started is None or now is None or started == now


def describe(holder: dict) -> str:
    return (f"pid {holder.get('pid', '?')} on host {holder.get('host', '?')} "
            f"since {holder.get('started', '?')}")


@dataclass
class RunLock:
    path: Path
    token: str
    released: bool = False

    def release(self) -> None:
        """Remove the lock if it is still ours (a lock broken by someone else is theirs)."""
        if self.released:
            return
        self.released = True
        if (self._holder() or {}).get("token") == self.token:
            self._remove()

    def _holder(self) -> Optional[dict]:
        return _read(self.path)

    def _remove(self) -> None:
        self.path.unlink(missing_ok=True)

    def __enter__(self) -> "RunLock":
        return self

    def __exit__(self, *exc) -> None:
        self.release()


def _read(path: Path) -> Optional[dict]:
    """The lock's holder, {} when unreadable (being written, or garbage), None when absent."""
    try:
        data = json.loads(path.read_text())
        return data if isinstance(data, dict) else {}
    except FileNotFoundError:
        return None
    except (OSError, ValueError):
        return {}


def _create(path: Path, holder: dict) -> bool:
    """Create the lock file exclusively with `holder` in it; False if it exists."""
    try:
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
    except FileExistsError:
        return False
    with os.fdopen(fd, "w") as f:
        f.write(json.dumps(holder) + "\n")
        f.flush()
        os.fsync(f.fileno())
    return True


def _take_over(path: Path, seen: dict) -> bool:
    """Move the stale lock `seen` out of the way; False if the file changed meanwhile."""
    private = path.with_name(f"{path.name}.stale-{os.getpid()}-{uuid.uuid4().hex[:8]}")
    try:
        os.rename(path, private)
    except FileNotFoundError:
        return True  # someone else removed it: just try to create
    if _read(private) != seen:  # a fresh lock was created after we looked: give it back
        try:
            os.link(private, path)
        except FileExistsError:
            pass
        private.unlink(missing_ok=True)
        return False
    private.unlink(missing_ok=True)
    return True


def _me(token: str) -> dict:
    """This process as a lock holder."""
    return {"pid": os.getpid(), "host": socket.gethostname(), "pid_start": _proc_start(os.getpid()), "token": token,
            "started": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}


def acquire(out_dir: str | Path, break_lock: bool = False, log: Callable[[str], None] = print,
            wait_unreadable_s: float = 2.0) -> RunLock:
    """Lock `out_dir` for this process (creating the folder), or raise RunLockError naming the
    holder. Stale locks are reported through `log` and taken over; break_lock=True takes over any
    lock (the user vouches that its run is gone). Released by `RunLock.release` or at exit."""
    path = Path(out_dir) / LOCK_NAME
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise RunLockError(f"cannot create run folder {path.parent}: {e.strerror}") from None
    host, token = socket.gethostname(), uuid.uuid4().hex
    me = _me(token)
    deadline = time.monotonic() + wait_unreadable_s
    while True:
        if _create(path, me):
            lock = RunLock(path, token)
            atexit.register(lock.release)
            return lock
        holder = _read(path)
        if holder is None:
            continue  # released meanwhile
        if not holder and time.monotonic() < deadline:
            time.sleep(0.05)  # being written by its creator right now
            continue
        _judge(str(path), str(path.parent), holder, host, break_lock, log)
        _take_over(path, holder)


def _judge(where: str, folder: str, holder: dict, host: str, break_lock: bool, log: Callable[[str], None]) -> None:
    """Return when the lock `where` held by `holder` may be taken over (saying why through
    `log`); raise RunLockError naming the holder when it may not."""
    if holder.get("host") == host and holder.get("pid") == os.getpid():
        return  # this process's own earlier lock (an earlier run in the same process)
    if break_lock:
        log(f"[vlp] broke the lock {where} of {describe(holder)} (train.break_lock=true)")
    elif not holder:
        log(f"[vlp] took over the unreadable lock {where} (empty or garbled, no holder to ask)")
    elif holder.get("host") != host:
        raise RunLockError(
            f"run folder {folder} is locked by {describe(holder)} ({where}); this host ({host}) cannot "
            "tell whether that run is alive: wait for it, use another train.output_dir, or set "
            "train.break_lock=true if it is gone")
    elif _holder_alive(holder):
        raise RunLockError(
            f"run folder {folder} is in use by another trainer: {describe(holder)} ({where}); "
            "wait for it to end or use another train.output_dir")
    else:
        log(f"[vlp] took over the stale lock {where} of {describe(holder)} (that process is gone)")


class BucketLock(RunLock):
    """`vlp.lock` as an object in a bucket run folder (vlp.storage.RunFolder): `path` is the folder."""

    def _holder(self) -> Optional[dict]:
        try:
            return _read_object(self.path)
        except Exception:  # noqa: BLE001 (as in _remove)
            return None

    def _remove(self) -> None:
        try:
            self.path.remove(LOCK_NAME)
        except Exception:  # noqa: BLE001 (at exit: a lost network must not hide the run's own error)
            pass


def _read_object(folder) -> Optional[dict]:
    try:
        data = json.loads(folder.read_bytes(LOCK_NAME))
        return data if isinstance(data, dict) else {}
    except FileNotFoundError:
        return None
    except ValueError:
        return {}


def acquire_bucket(folder, break_lock: bool = False, log: Callable[[str], None] = print) -> BucketLock:
    """Lock a bucket run folder: `vlp.lock` created with create-if-absent (S3 If-None-Match,
    GCS ifGenerationMatch=0: exactly one creator wins), the same holder rules as `acquire`.
    A stale lock is deleted and created again; of two takers only one creates it."""
    token, where = uuid.uuid4().hex, folder.path(LOCK_NAME)
    data = (json.dumps(_me(token)) + "\n").encode()
    for _ in range(5):
        try:
            folder.fs.pipe_file(folder._key(LOCK_NAME), data, mode="create")
        except FileExistsError:
            holder = _read_object(folder)
            if holder is not None:
                _judge(where, folder.url, holder, socket.gethostname(), break_lock, log)
                folder.remove(LOCK_NAME)
            continue
        lock = BucketLock(folder, token)
        atexit.register(lock.release)
        return lock
    raise RunLockError(f"run folder {folder.url}: could not take {where} (other writers keep taking it)")


def acquire_on_main(folder, break_lock: bool, is_main: bool,
                    log: Callable[[str], None] = print) -> Optional[RunLock]:
    """`acquire` (or `acquire_bucket` for a RunFolder in a bucket) on the main process, agreed
    by all ranks: every rank raises the same RunLockError when it is refused (no rank goes on to
    wait in a collective). A collective when a process group exists."""
    lock, error = None, None
    if is_main:
        try:
            remote = getattr(folder, "remote", False)
            lock = acquire_bucket(folder, break_lock, log) if remote else acquire(getattr(folder, "root", folder),
                                                                                 break_lock, log)
        except RunLockError as e:
            error = str(e)
    from vlp.distributed import broadcast_object

    error = broadcast_object(error)
    if error:
        raise RunLockError(error)
    return lock
