"""One writer per run folder: `vlp.lock` in it, created only if absent (RunFolder.create: O_EXCL,
also on NFSv3+/Lustre/GPFS, or a conditional PUT in S3 or GCS) by the main process, released at
exit. It names its holder (pid, host, start time, the pid's start time: a reused pid is not it).
A live holder is refused in one line; a gone one (same host) is taken over: the lock is moved to a
private name, re-read, put back if it was fresh meanwhile, then created again, which only one
taker can do. Another host's lock is refused unless train.break_lock=true.
"""

from __future__ import annotations

import atexit
import contextlib
import datetime
import json
import os
import socket
import time
import uuid
from dataclasses import dataclass
from typing import Callable, Optional

from vlp.distributed import broadcast_object
from vlp.checkpoint.storage import RunFolder
from vlp.util import pid_alive, proc_start

LOCK_NAME = "vlp.lock"


class RunLockError(ValueError):
    """The run folder is held by another writer; the message is one line for the user."""


def describe(holder: dict) -> str:
    return f"pid {holder.get('pid', '?')} on host {holder.get('host', '?')} since {holder.get('started', '?')}"


@dataclass
class RunLock:
    folder: RunFolder
    token: str

    def release(self) -> None:
        """Remove the lock if it is still ours (a lock broken by someone else is theirs)."""
        atexit.unregister(self.release)  # released once: not again at exit
        with contextlib.suppress(Exception):  # at exit: a lost network must not hide the run's own error
            if (_read(self.folder) or {}).get("token") == self.token:
                self.folder.remove(LOCK_NAME)


def _read(folder: RunFolder, name: str = LOCK_NAME) -> Optional[dict]:
    """The lock's holder, {} when unreadable (being written, or garbage), None when absent."""
    try:
        data = json.loads(folder.read_bytes(name))
        return data if isinstance(data, dict) else {}
    except FileNotFoundError:
        return None
    except (OSError, ValueError):
        return {}


def _take_over(folder: RunFolder, seen: dict) -> None:
    """Move the stale lock `seen` out of the way; a fresh lock found there instead is put back."""
    private = f"{LOCK_NAME}.stale-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    try:
        folder.move(LOCK_NAME, private)
    except FileNotFoundError:
        return  # someone else removed it: just try to create
    if _read(folder, private) != seen:  # a fresh lock was created after we looked: give it back
        folder.create(LOCK_NAME, folder.read_bytes(private))
    folder.remove(private)


def _me(token: str) -> bytes:
    me = {"pid": os.getpid(), "host": socket.gethostname(), "pid_start": proc_start(os.getpid()), "token": token,
          "started": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}
    return (json.dumps(me) + "\n").encode()


def acquire(folder: RunFolder, break_lock: bool = False, log: Callable[[str], None] = print,
            wait_unreadable_s: float = 2.0) -> RunLock:
    """Lock the RunFolder `folder` for this process, or RunLockError naming the holder; a stale
    lock (any, with break_lock) is taken over, saying so through `log`."""
    token = uuid.uuid4().hex
    deadline = time.monotonic() + wait_unreadable_s
    while True:
        try:
            created = folder.create(LOCK_NAME, _me(token))
        except OSError as e:
            raise RunLockError(f"cannot create run folder {folder.url}: {e.strerror or e}") from None
        if created:
            lock = RunLock(folder, token)
            atexit.register(lock.release)
            return lock
        holder = _read(folder)
        if holder is None:
            continue  # released meanwhile
        if not holder and time.monotonic() < deadline:
            time.sleep(0.05)  # being written by its creator right now
            continue
        _judge(folder.path(LOCK_NAME), folder.url, holder, break_lock, log)
        _take_over(folder, holder)


def _judge(where: str, folder: str, holder: dict, break_lock: bool, log: Callable[[str], None]) -> None:
    """Return (saying why) when `holder`'s lock `where` may be taken over, else RunLockError."""
    host = socket.gethostname()
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
    elif isinstance(holder.get("pid"), int) and pid_alive(holder["pid"], holder.get("pid_start")):
        raise RunLockError(
            f"run folder {folder} is in use by another trainer: {describe(holder)} ({where}); "
            "wait for it to end or use another train.output_dir")
    else:
        log(f"[vlp] took over the stale lock {where} of {describe(holder)} (that process is gone)")


def acquire_on_main(folder: RunFolder, break_lock: bool, is_main: bool,
                    log: Callable[[str], None] = print) -> Optional[RunLock]:
    """`acquire` on the main process; every rank raises its RunLockError (no rank goes on to wait
    in a collective). A collective when a process group exists."""
    lock, error = None, None
    if is_main:
        try:
            lock = acquire(folder, break_lock, log)
        except RunLockError as e:
            error = str(e)
    error = broadcast_object(error)
    if error:
        raise RunLockError(error)
    return lock
