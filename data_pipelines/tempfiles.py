"""Temp files left by killed writers: `.NAME.tmp-PID` beside the file they would have become.

Checkpoints (vlp.checkpoint) and shards (data_pipelines.write) are written under such a name and
renamed when complete, so a SIGKILL leaves the temp file behind. One whose PID no longer runs
can never be finished: it is removed (and reported) when the next writer starts in that folder.
"""

from __future__ import annotations

import os
import re
from pathlib import Path


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
