"""Helpers shared by the top-level tests (a unique module name: conftest.py files collide)."""
import io
import os
import sys
import tarfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
PYTHON = sys.executable


def run_env() -> dict:
    """Environment for subprocesses: one thread each, repo on the path, no GPU."""
    return dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO), CUDA_VISIBLE_DEVICES="")


def write_tar(path, samples: list[tuple[str, dict[str, bytes]]]) -> Path:
    """A raw tar with the given (key, {ext: bytes}) members, in order (for fault injection)."""
    with tarfile.open(path, "w") as tar:
        for key, members in samples:
            for ext, data in members.items():
                info = tarfile.TarInfo(f"{key}.{ext}")
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))
    return Path(path)
