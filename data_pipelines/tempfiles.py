"""Atomic writes and the temp files killed writers leave: `.NAME.tmp-PID` beside the file they
would have become.

Files that must never be seen half-written (checkpoints, sizes.json, eval reports) are written
under such a name and renamed when complete (`atomic_write`), so a SIGKILL leaves the temp file
behind. One whose PID no longer runs can never be finished: it is removed (and reported) when
the next writer starts in that folder (`remove_stale_temps`).
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import BinaryIO, Callable, Union


def temp_name(path: str | os.PathLike) -> Path:
    """`.NAME.tmp-PID` beside `path`: unique per process, so concurrent writers never collide."""
    path = Path(path)
    return path.with_name(f".{path.name}.tmp-{os.getpid()}")


def atomic_write(path: str | os.PathLike, data: Union[bytes, str, Callable[[BinaryIO], None]], *,
                 fsync: bool = False) -> None:
    """Write `data` (bytes, UTF-8 text, or a function writing to the open binary file) to `path`
    through its temp name and a rename: readers see the old file or the whole new one. fsync:
    flush to disk before the rename (a checkpoint survives a power cut). On any error the temp
    file is removed and the error raised; `path` is unchanged."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = temp_name(path)
    try:
        with open(tmp, "wb") as f:
            if callable(data):
                data(f)
            else:
                f.write(data.encode("utf-8") if isinstance(data, str) else data)
            if fsync:
                f.flush()
                os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        if tmp.is_symlink() or tmp.exists():
            tmp.unlink()


def pid_alive(pid: int) -> bool:
    """Whether a process with this PID runs on this machine (signal 0 probes without sending)."""
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # it exists, owned by someone else
        return True
    return True


def remove_stale_temps(directory: str | os.PathLike, pattern: str) -> list[Path]:
    """Delete `directory`'s temp files whose name fully matches `pattern` (its last group is the
    writer's PID) and whose writer is dead; return them. Files of live writers are kept."""
    directory = Path(directory)
    if not directory.is_dir():
        return []
    regex = re.compile(pattern)
    removed = []
    for path in sorted(directory.iterdir()):
        m = regex.fullmatch(path.name)
        if m and not pid_alive(int(m.groups()[-1])) and not path.is_dir():
            path.unlink(missing_ok=True)
            removed.append(path)
    return removed
