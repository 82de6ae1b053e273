"""Helpers shared by the top-level tests (a unique module name: conftest.py files collide)."""
import contextlib
import io
import os
import subprocess
import sys
import tarfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
PYTHON = sys.executable
# `accelerate launch` without the `accelerate` command's dispatcher: the same parser and
# launch_command, minus the imports of its other subcommands (`estimate` pulls in timm and
# transformers): 2.2 instead of 5.2 CPU seconds per launch. The SLURM tests run the real command.
LAUNCH = [PYTHON, "-m", "accelerate.commands.launch"]
PORT_FLAG = "--main_process_port"
PORT_TAKEN = ("EADDRINUSE", "address already in use")  # torch's TCPStore, when the port is held

if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))
from bench._common import free_port, overrides  # noqa: E402  (one copy each, for benchmarks and tests)


def accelerate_cmd(*args: str, config: str | Path = "launch/cpu_2proc.yaml") -> list[str]:
    """`accelerate launch --config_file CONFIG --main_process_port PORT ARGS...` on a free port."""
    return [*LAUNCH, "--config_file", str(config), PORT_FLAG, str(free_port()), *args]


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


def kill_job(launcher_pid: int) -> None:
    """SIGKILL a launched job whole: the launcher's process group, and each rank's (torch starts
    every rank in a session of its own, with its loader workers). A launcher killed alone is not
    a lost job: its ranks save and exit (vlp.distributed.exit_with_launcher)."""
    import signal

    ranks = subprocess.run(["pgrep", "-P", str(launcher_pid)], capture_output=True, text=True).stdout.split()
    for group in [launcher_pid, *map(int, ranks)]:
        try:
            os.killpg(group, signal.SIGKILL)
        except ProcessLookupError:
            pass


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

# the FSDP and bucket runs' common settings (tests/train/test_fsdp.py, tests/checkpoint/test_bucket_runs.py)
FSDP_COMMON = ["model.name=vlp-micro", "data.batch_per_device=8", "data.num_workers=0", "optim.lr=1e-3",
          "optim.warmup_steps=2", "train.log_every=1", "data.shuffle_buffer=32", "train.samples=192",
          "train.keep_last=20", "train.checkpoint_every=4"]


@contextlib.contextmanager
def cpu_hog(processes: int = 1):
    """A loaded box: `processes` busy loops beside the test, ended (and reaped) as it leaves."""
    hogs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(processes)]
    try:
        yield hogs
    finally:
        for hog in hogs:
            hog.kill()
            hog.wait()
