"""The ground floor: small helpers every part of vlp uses, importing nothing of vlp.

- One-line user messages (`first_line`, `cap`): every user error reaches the terminal as one line
  (`vlp: error: ...`, vlp/cli.py); `cap` bounds a line at MAX_LINE characters.
- Atomic writes and the temp files killed writers leave (`atomic_write`, `remove_stale_temps`,
  `pid_alive`): `.NAME.tmp-PID` beside the file it would have become; a SIGKILL leaves it behind,
  and the next writer in that folder removes those whose PID no longer runs (`proc_start` tells
  a reused PID apart: the run lock records it).
- Strict YAML (`load_yaml`): yaml.safe_load, except that a mapping with the same key twice is
  refused (configs, compare grids, eval suites).
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any, BinaryIO, Callable, Optional, Union

import yaml


MAX_LINE = 500
"""Characters an error line may hold; the middle of a longer one is elided."""


def cap(text: str, limit: int = MAX_LINE) -> str:
    """`text` if at most `limit` characters, else its head and tail around ' ... (N chars) ... '
    (both ends: the start names what failed, the end often says why)."""
    if len(text) <= limit:
        return text
    mark = f" ... ({len(text)} chars) ... "
    keep = max(0, limit - len(mark))
    head = (keep * 2) // 3
    return text[:head] + mark + text[len(text) - (keep - head):]


def first_line(error: BaseException) -> str:
    """'ErrorType: first line of its message' (the type alone for an empty message), capped."""
    text = str(error).strip()
    return cap(f"{type(error).__name__}: {text.splitlines()[0]}") if text else type(error).__name__


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


def pid_alive(pid: int, started: Optional[str] = None) -> bool:
    """Whether a process with this PID runs on this machine (signal 0 probes without sending);
    given `started` (its `proc_start` then), not a later process that reuses the PID."""
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # it exists, owned by someone else
        pass
    now = None if started is None else proc_start(pid)
    return started is None or now is None or started == now


def proc_start(pid: int) -> Optional[str]:
    """The kernel's start time of `pid` (clock ticks since boot; Linux), None where unknown."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
        return stat.rsplit(")", 1)[1].split()[19]  # field 22 counted from the pid
    except (OSError, IndexError):
        return None


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


class DuplicateKey(ValueError):
    """'duplicate key 'lr' on line 9 (first on line 4)'."""


def _short(key: Any, limit: int = 60) -> str:
    text = repr(key)
    return text if len(text) <= limit else text[:limit] + "..."


class _UniqueKeyLoader(yaml.SafeLoader):
    """yaml.SafeLoader that refuses a mapping with the same key twice (PyYAML keeps the last one
    silently: `lr: 1e-3` ... `lr: 1e-5` would train with whichever came second)."""


def _unique_mapping(loader: _UniqueKeyLoader, node: yaml.MappingNode, deep: bool = False) -> dict:
    seen: dict = {}
    for key_node, _ in node.value:  # the keys written here (a key may override one merged by <<)
        if key_node.tag == "tag:yaml.org,2002:merge":
            continue
        key = loader.construct_object(key_node, deep=True)
        line = key_node.start_mark.line + 1
        try:
            if key in seen:
                raise DuplicateKey(f"duplicate key {_short(key)} on line {line} (first on line {seen[key]})")
            seen[key] = line
        except TypeError:  # an unhashable key: the base constructor names it
            break
    return yaml.SafeLoader.construct_mapping(loader, node, deep)


_UniqueKeyLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _unique_mapping)


def load_yaml(text: str) -> Any:
    """Parse `text`; DuplicateKey names the key and both lines."""
    return yaml.load(text, Loader=_UniqueKeyLoader)

