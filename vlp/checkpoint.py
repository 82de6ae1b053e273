"""Atomic checkpoints, keep-last-k, `resume: latest`, and safe loading.

A checkpoint is one `torch.save` file of plain tensors and containers, so it is read back with
`torch.load(weights_only=True)`: nothing from a file is unpickled as an arbitrary object.
It is written to a temporary name in the same folder, fsynced, then renamed: a crash while
writing leaves the previous checkpoint intact and never a half-written file under a final name.
"""

from __future__ import annotations

import os
import random
import re
from pathlib import Path
from typing import Optional

import torch

CKPT_RE = re.compile(r"step_(\d+)\.pt$")


def atomic_save(obj, path: str | Path) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        with open(tmp, "wb") as f:
            torch.save(obj, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()


def load(path: str | Path) -> dict:
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"checkpoint not found: {path}")
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # truncated file, wrong format, pickled objects
        raise ValueError(f"checkpoint {path} cannot be read safely: {type(e).__name__}: {str(e).splitlines()[0]}") from None


def list_checkpoints(ckpt_dir: str | Path) -> list[Path]:
    """Step checkpoints in `ckpt_dir`, oldest first."""
    ckpt_dir = Path(ckpt_dir)
    if not ckpt_dir.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in ckpt_dir.iterdir() if (m := CKPT_RE.search(p.name))]
    return [p for _, p in sorted(found)]


def latest_checkpoint(ckpt_dir: str | Path) -> Optional[Path]:
    ckpts = list_checkpoints(ckpt_dir)
    return ckpts[-1] if ckpts else None


def prune(ckpt_dir: str | Path, keep_last: int) -> None:
    for old in list_checkpoints(ckpt_dir)[:-keep_last] if keep_last > 0 else []:
        old.unlink(missing_ok=True)


def rng_state() -> dict:
    state = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(_tuplify(state["python"]))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def _tuplify(x):
    return tuple(_tuplify(v) for v in x) if isinstance(x, (list, tuple)) else x
