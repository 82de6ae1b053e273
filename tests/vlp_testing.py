"""Helpers shared by the top-level tests (a unique module name: conftest.py files collide)."""
import io
import os
import shutil
import socket
import subprocess
import sys
import tarfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
PYTHON = sys.executable
ACCELERATE = shutil.which("accelerate", path=str(Path(PYTHON).parent)) or "accelerate"
PORT_FLAG = "--main_process_port"
PORT_TAKEN = ("EADDRINUSE", "address already in use")  # torch's TCPStore, when the port is held


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing holds now, the kernel's pick (bind port 0, read it,
    close): unlike a port derived from the pytest pid, two xdist workers (or two pytest sessions
    on one machine) do not draw the same one. Another process can still take it before the caller
    binds it; run_launch() then tries once more."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def accelerate_cmd(*args: str, config: str | Path = "launch/cpu_2proc.yaml") -> list[str]:
    """`accelerate launch --config_file CONFIG --main_process_port PORT ARGS...` on a free port."""
    return [ACCELERATE, "launch", "--config_file", str(config), PORT_FLAG, str(free_port()), *args]


def run_launch(cmd: list[str], *, timeout: float, **kwargs) -> subprocess.CompletedProcess:
    """subprocess.run of an `accelerate launch` command, output captured as text. When its port
    was taken between free_port() and the launcher's bind (the launcher's TCPStore fails before
    any rank starts, so nothing was written), the same command once more on a new port."""
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, **kwargs)
    if proc.returncode != 0 and any(s in proc.stderr for s in PORT_TAKEN):
        at = cmd.index(PORT_FLAG) + 1
        cmd = [*cmd[:at], str(free_port()), *cmd[at + 1:]]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, **kwargs)
    return proc


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
