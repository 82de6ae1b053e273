"""A run stopped as users stop it, in segments: each segment is one process group started from the
newest checkpoint (train.resume=latest), signalled once it trains, its stderr collected by a
thread. Shared by tests/train/test_stop_signals.py (plain runs, launch/local.sh) and
tests/train/test_bare_launchers.py (a bare `accelerate launch` / torchrun)."""
import ctypes
import json
import os
import signal
import subprocess
import threading
import time
from pathlib import Path

import torch

import forked
from vlp_testing import REPO, overrides

STEPS = 60  # 480 samples at batch 8 (world 1); 160 pairs per epoch
TINY = ["model.name=vlp-micro", "data.batch_per_device=8", "optim.lr=1e-3", "optim.warmup_steps=2",
        "train.log_every=1", "data.shuffle_buffer=32", "data.eval_shards=null", "data.num_workers=2",
        "train.checkpoint_every=4", "train.keep_last=0"]


def train_args(shards, out, *extra):
    return ["-m", "vlp", "train", "-c", "configs/demo.yaml", *overrides(
        f"data.train_shards={shards['train']}", f"train.output_dir={out}", *TINY, *extra)]


def last_step(out: Path) -> int:
    log = out / "log.jsonl"
    if not log.exists():
        return 0
    steps = [r["step"] for r in map(json.loads, log.read_text().splitlines()) if "infonce" in r]
    return max(steps, default=0)


def saved_steps(out: Path) -> list[int]:
    return sorted(int(p.stem.split("_")[1]) for p in (out / "checkpoints").glob("step_*.pt"))


def final_weights(out: Path) -> dict:
    return torch.load(out / "open_clip_model.pt", weights_only=True)["state_dict"]


def child_pids(pid: int) -> list[int]:
    found = subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True).stdout
    return [int(x) for x in found.split()]


def is_alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"
    except (FileNotFoundError, IndexError):
        return False


class Segment:
    """One process group's run from the newest checkpoint; stderr collected by a thread (so a
    test can wait for a line while the run goes on)."""

    def __init__(self, cmd, env, after: int):
        self.proc = forked.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                 text=True, start_new_session=True)
        self.err: list[str] = []
        self.reader = threading.Thread(target=lambda: self.err.extend(self.proc.stderr), daemon=True)
        self.reader.start()
        self.after = after
        self.ranks: list[int] = []  # a bare launcher's ranks: each in a session of its own (torch)

    def wait_for(self, out: Path, steps: int = 2, limit_s: float = 240) -> None:
        """Until the run has logged `steps` steps past its start."""
        deadline = time.time() + limit_s
        while last_step(out) < self.after + steps:
            assert self.proc.poll() is None, f"ended ({self.proc.returncode}) first:\n{self.text()[-3000:]}"
            assert time.time() < deadline, f"no step {self.after + steps} in {limit_s} s"
            time.sleep(0.05)

    def signal(self, sig: int) -> None:
        os.killpg(self.proc.pid, sig)

    def end(self, limit_s: float = 240) -> tuple[int, str]:
        try:
            code = self.proc.wait(timeout=limit_s)
        except subprocess.TimeoutExpired:
            os.kill(self.proc.pid, signal.SIGABRT)  # PYTHONFAULTHANDLER: its threads' stacks
            self.proc.wait(30)
            raise AssertionError(f"no end in {limit_s} s:\n{self.text()[-6000:]}") from None
        finally:
            if self.proc.poll() is None:
                os.killpg(self.proc.pid, signal.SIGKILL)
            self._end_ranks(limit_s)
        self.reader.join(30)
        return code, self.text()

    def _end_ranks(self, limit_s: float) -> None:
        """Ranks that outlive their launcher (it died: they save, then exit) get `limit_s` to end,
        then are killed with their loader workers."""
        deadline = time.time() + limit_s
        while any(map(is_alive, self.ranks)) and time.time() < deadline:
            time.sleep(0.05)
        left = [r for r in self.ranks if is_alive(r)]
        for rank in left:
            os.killpg(rank, signal.SIGKILL)
        assert not left, f"ranks {left} outlived their launcher by {limit_s} s:\n{self.text()[-4000:]}"

    def text(self) -> str:
        return "".join(self.err).replace("\r", "\n")


def vlp_lines(err: str) -> list[str]:
    return [x[x.index("vlp: "):] for x in err.splitlines() if "vlp: " in x]


def ctrl_c_twice(seg: Segment, pids: list[int], groups: list[int]) -> None:
    """Ctrl-C twice in quick succession, deterministically: `groups` (the run's processes)
    stopped, SIGINT to the run's process group (pending in each of `pids` once it arrives: a
    launched rank gets it from launch/local.sh), then to each of `pids`' main thread (pending for
    that thread: a second SIGINT, not merged with the first); both are delivered when the
    processes continue, before any step can end."""
    for group in groups:
        os.killpg(group, signal.SIGSTOP)
    until("the processes stopped", lambda: all(state(pid) == "T" for pid in pids))  # kill() does not wait
    seg.signal(signal.SIGINT)
    until("the first SIGINT reached them", lambda: all(pending(pid, signal.SIGINT) for pid in pids))
    for pid in pids:
        tgkill(pid, pid, signal.SIGINT)
    for group in groups:
        os.killpg(group, signal.SIGCONT)


def until(what: str, done, limit_s: float = 60) -> None:
    deadline = time.time() + limit_s
    while not done():
        assert time.time() < deadline, f"{what}: not in {limit_s} s"
        time.sleep(0.01)


def state(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return ""


def pending(pid: int, sig: int) -> bool:
    """Whether `sig` waits for the process `pid`: sent to it as a whole (a stopped one does not take
    it), or to its main thread."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return False
    masks = [int(x.split()[1], 16) for x in status.splitlines() if x.startswith(("SigPnd:", "ShdPnd:"))]
    return any(mask >> (sig - 1) & 1 for mask in masks)


def tgkill(tgid: int, tid: int, sig: int) -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.tgkill(tgid, tid, int(sig)) != 0:
        raise OSError(ctypes.get_errno(), f"tgkill({tgid}, {tid}, {sig})")


def check_end(code: int, err: str, want_code: int, *words: str) -> list[str]:
    lines = vlp_lines(err)
    assert code == want_code and "Traceback" not in err, (code, err[-4000:])
    for w in words:
        assert sum(w in x for x in lines) == 1, (w, lines, err[-4000:])
    return lines


