"""Helpers shared by the top-level tests (a unique module name: conftest.py files collide)."""
import io
import os
import sys
import tarfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
PYTHON = sys.executable


def overrides(*items: str) -> list[str]:
    """`key=value` overrides for a command line, a later item replacing an earlier one of the same
    key: tests add their own settings to a shared base list, and `vlp` refuses a key given twice."""
    merged: dict[str, str] = {}
    for item in items:
        merged[item.split("=", 1)[0]] = item
    return list(merged.values())


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


def noise_jpeg(seed: int, size: int = 64) -> bytes:
    """A JPEG whose entropy-coded data is most of the file (a cut keeps the header intact)."""
    import random

    from PIL import Image

    buf = io.BytesIO()
    pixels = random.Random(seed).randbytes(size * size * 3)
    Image.frombytes("RGB", (size, size), pixels).save(buf, format="JPEG", quality=90)
    return buf.getvalue()
