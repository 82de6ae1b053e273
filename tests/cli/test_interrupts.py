"""Ctrl-C of `vlp compare` and `vlp eval` as a terminal sends it (issue 41): SIGINT to the
command's whole process group (its worker processes and loader workers included), once, or twice
in quick succession. Each stop is one `vlp:` line, exit status 130 and no traceback; what had
finished before the signal is on disk and reads back; a `vlp compare` rerun reuses the finished
runs and completes the grid. Every wait is for a sign of progress in the output folder or on
stderr, bounded, and a command still running at its limit has its group killed."""
import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

import forked
from stops import pending, state, tgkill, until, vlp_lines
from vlp.train.interrupt import FIRST, SECOND
from vlp_testing import PYTHON, REPO, overrides, run_env

pytestmark = pytest.mark.multiproc  # every test here starts process groups

INTERRUPTED = "vlp: interrupted"  # cli.main's KeyboardInterrupt line, or a run's "interrupted at step N"


class Group:
    """`python -m vlp ARGS` in a session (and process group) of its own, as a terminal starts a
    command; stdout and stderr go to files that the test reads while it runs."""

    def __init__(self, args: list, tmp: Path, name: str, cwd: Path = REPO):
        self.out_file, self.err_file = tmp / f"{name}.stdout", tmp / f"{name}.stderr"
        with open(self.out_file, "w") as out, open(self.err_file, "w") as err:
            self.proc = forked.Popen([PYTHON, "-m", "vlp", *map(str, args)], cwd=cwd,
                                     env=run_env() | {"PYTHONFAULTHANDLER": "1"},
                                     stdout=out, stderr=err, start_new_session=True)

    def until(self, what: str, done, limit_s: float = 240) -> None:
        """Poll `done()` until true; fails if the command ends first or the limit passes."""
        deadline = time.time() + limit_s
        while not done():
            if self.proc.poll() is not None:
                raise AssertionError(f"ended ({self.proc.returncode}) before {what}:\n{self.err()[-3000:]}")
            if time.time() > deadline:
                self.kill()
                raise AssertionError(f"no {what} in {limit_s} s:\n{self.err()[-3000:]}")
            time.sleep(0.02)

    def ctrl_c(self) -> None:
        os.killpg(self.proc.pid, signal.SIGINT)

    def end(self, limit_s: float = 120) -> int:
        try:
            return self.proc.wait(timeout=limit_s)
        except subprocess.TimeoutExpired:
            tree = subprocess.run(["ps", "-o", "pid,ppid,stat,wchan:24,etime,args", "-g", str(self.proc.pid)],
                                  capture_output=True, text=True).stdout
            for pid in _group(self.proc.pid):  # PYTHONFAULTHANDLER: each Python process's stacks
                os.kill(pid, signal.SIGABRT)
            time.sleep(2)
            raise AssertionError(f"no end in {limit_s} s:\n{tree}\n{self.err()[-12000:]}") from None
        finally:
            self.kill()

    def kill(self) -> None:
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait(30)

    def gone(self) -> bool:
        """Whether every process of the group (worker processes, loader workers) has ended."""
        try:
            os.killpg(self.proc.pid, 0)
        except ProcessLookupError:
            return True
        return all(state(pid) in ("Z", "") for pid in _group(self.proc.pid))

    def out(self) -> str:
        return self.out_file.read_text()

    def err(self) -> str:
        return self.err_file.read_text().replace("\r", "\n")


def _group(pgid: int) -> list[int]:
    found = subprocess.run(["pgrep", "-g", str(pgid)], capture_output=True, text=True).stdout
    return [int(x) for x in found.split()]


def _stopped_once(code: int, err: str, sig: int = signal.SIGINT) -> str:
    """A first Ctrl-C's exit: 130, no traceback, one line saying it was interrupted (beside the
    first Ctrl-C's 'saving a checkpoint' notice when a run was training in this process); that line.
    SIGTERM / SIGUSR1: 75 and one line saying it was preempted; SIGHUP: 129, 'hung up'."""
    lines = [x for x in vlp_lines(err) if not x.startswith("vlp: warning:")]
    status, word = {signal.SIGINT: (130, INTERRUPTED), signal.SIGHUP: (129, "vlp: hung up")}.get(sig, (75, "vlp: preempted"))
    assert code == status and "Traceback" not in err, (code, err[-4000:])
    stops = [x for x in lines if x.startswith(word)]
    assert len(stops) == 1 and set(lines) - {FIRST.strip()} == set(stops), (lines, err[-4000:])
    return stops[0]


# ----------------------------------------------------------------------------- vlp compare
def _compare(shards, out: Path, workers: int) -> list:
    """The shipped map config's --quick study, cut to 4 runs (2 losses x 2 seeds, batch 8, one
    lr, 20 steps each, a log record per step) on the tiny shards, 2 loader workers per run."""
    return ["compare", "-c", REPO / "configs/compare_small_batch.yaml", "--quick", *overrides(
        f"data.train_shards={shards['train']}", f"data.eval_shards={shards['eval']}",
        f"grid.test_shards={shards['eval']}", f"grid.out_dir={out}", "train.samples=160", "data.shuffle_buffer=32",
        "data.num_workers=2", "grid.warmup_samples=8", "grid.log_every_samples=8", "grid.losses=[infonce,flatnce]",
        "grid.batch_per_device=[8]", "grid.seeds=[0,1]", "grid.final_seeds=[0,1]", "grid.sweep={optim.lr: [0.001]}",
        "grid.sweep_bounds=null", "grid.seeds_until=null", "grid.regimes={scratch: {}}", "grid.datasets=null",
        "grid.accum_price=null", "grid.budget_points=1", f"grid.workers={workers}")]


RUNS = 4


def _finished(out: Path) -> dict[str, float]:
    """The runs the study counts as done (result.json and eval_items.json: vlp.study.runs.plan_runs),
    each with its result.json's mtime."""
    return {p.parent.name: p.stat().st_mtime_ns for p in out.glob("*/result.json")
            if (p.parent / "eval_items.json").exists()}


def _training(out: Path, before_step: int = 8) -> list[str]:
    """Runs that are not done and whose last training step logged is below `before_step` (of 20):
    a stop now comes inside their training loop, not in their final evaluation."""
    done, found = _finished(out), []
    for log in out.glob("*/log.jsonl"):
        steps = [json.loads(x).get("step", 0) for x in log.read_text().splitlines() if '"type": "train"' in x]
        if log.parent.name not in done and steps and max(steps) < before_step:
            found.append(log.parent.name)
    return found


def _check_finished(out: Path, names) -> None:
    """Each run is complete: its result files parse, and its record, if written, says ok (a second
    Ctrl-C may end the command between a run's last file and its compare.json, which the study
    reads for a failed run's error only: vlp.study.rows.run_row)."""
    for name in names:
        run = out / name
        result = json.loads((run / "result.json").read_text())
        items = json.loads((run / "eval_items.json").read_text())
        assert result["samples_seen"] == 160 and "test" in items and "val" in items, (name, result)
        if (run / "compare.json").exists():
            assert json.loads((run / "compare.json").read_text())["status"] == "ok", name


def _mid_grid(group: Group, out: Path, more_than: int = 0) -> dict[str, float]:
    """Waits until more than `more_than` runs are done and another trains; returns the finished
    runs (name -> mtime)."""
    group.until("a finished run beside a training one", lambda: len(_finished(out)) > more_than and _training(out))
    return _finished(out)


@pytest.mark.parametrize("workers, sigs", [(1, (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)), (2, (signal.SIGUSR1,))],
                         ids=["1-INT-TERM-HUP", "2-USR1"])
def test_compare_stopped_mid_grid_keeps_finished_runs_and_a_rerun_resumes(tiny_shards, tmp_path, workers, sigs):
    """grid.workers=1 (the runs in the command's own process) and 2 (the --quick default: spawned
    worker processes): a Ctrl-C, SIGTERM, SIGUSR1 or SIGHUP (a closed terminal) to the group while a
    run trains, with another already finished. With several signals, one after another on the same
    grid: each rerun reuses what is done, finishes one more run and is stopped by the next signal;
    the last rerun completes the grid."""
    out = tmp_path / "grid"
    args = _compare(tiny_shards, out, workers)
    after: dict[str, float] = {}
    for n, sig in enumerate(sigs):
        first = Group(args, tmp_path, f"stopped{n}")
        before = _mid_grid(first, out, more_than=len(after))
        os.killpg(first.proc.pid, sig)
        code = first.end()
        err = first.err()
        line = _stopped_once(code, err, sig)
        if n:
            assert f"[compare] {RUNS} runs ({len(after)} already done)" in first.out(), first.out()[-3000:]
        done_before, after = after, _finished(out)
        assert before.items() <= after.items(), (before, after)  # nothing finished was redone or lost
        assert all(after[name] == mtime for name, mtime in done_before.items()), (done_before, after)
        _check_finished(out, after)
        assert len(after) < RUNS, (after, line)  # it stopped mid-grid
        for run in out.iterdir():  # a run not done left no record claiming it is
            if run.is_dir() and run.name not in after:
                assert not (run / "compare.json").exists() or json.loads((run / "compare.json").read_text())[
                    "status"] != "ok", run.name
        deadline = time.time() + 30
        while not first.gone() and time.time() < deadline:
            time.sleep(0.05)
        assert first.gone(), "a process of the stopped command outlived it"

    again = Group(args, tmp_path, "again")
    code = again.end(240)
    assert code == 0 and "Traceback" not in again.err(), (code, again.err()[-4000:])
    assert f"[compare] {RUNS} runs ({len(after)} already done)" in again.out(), again.out()[-3000:]
    final = _finished(out)
    assert len(final) == RUNS and all(final[name] == mtime for name, mtime in after.items()), (after, final)
    _check_finished(out, final)
    assert (out / "study.md").is_file() and json.loads((out / "study.json").read_text())


# ----------------------------------------------------------------------------- two Ctrl-C
def _twice(group: Group) -> None:
    """Two Ctrl-C in quick succession, deterministically: the group stopped, SIGINT to the group
    (pending in the main process), then to the main process's main thread (pending for that
    thread: a second SIGINT, not merged with the first); both arrive when the group continues,
    before any step can end."""
    pid = group.proc.pid
    os.killpg(pid, signal.SIGSTOP)
    until("the processes stopped", lambda: all(state(p) in ("T", "Z", "") for p in _group(pid)))
    os.killpg(pid, signal.SIGINT)
    until("the first SIGINT reached the main process", lambda: pending(pid, signal.SIGINT))
    tgkill(pid, pid, signal.SIGINT)
    os.killpg(pid, signal.SIGCONT)


@pytest.mark.parametrize("workers", [1, 2])
def test_compare_second_ctrl_c_exits_at_once(tiny_shards, tmp_path, workers):
    """The second Ctrl-C while the first one's save is under way: out at once with the
    second Ctrl-C's line, exit 130, no traceback; the finished runs are kept and no process of the
    command is left."""
    out = tmp_path / "grid"
    args = _compare(tiny_shards, out, workers)
    first = Group(args, tmp_path, "first")
    before = _mid_grid(first, out)
    _twice(first)
    code = first.end()
    err = first.err()
    lines = vlp_lines(err)
    assert code == 130 and "Traceback" not in err, (code, err[-4000:])
    assert lines == [FIRST.strip(), SECOND.strip()], (lines, err[-4000:])
    after = _finished(out)
    assert before.items() <= after.items(), (before, after)
    _check_finished(out, after)
    deadline = time.time() + 30
    while not first.gone() and time.time() < deadline:
        time.sleep(0.05)
    assert first.gone(), "a process of the aborted command outlived it"
    # a rerun resumes as after one Ctrl-C (test_compare_stopped_mid_grid_...): what is on disk is the same kind


# ----------------------------------------------------------------------------- vlp eval
@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """An open_clip export of an untrained vlp-micro model."""
    from vlp.config import LossConfig, ModelConfig
    from vlp.models.model import build_model, export_open_clip

    path = tmp_path_factory.mktemp("export") / "micro.pt"
    export_open_clip(build_model(ModelConfig(name="vlp-micro"), LossConfig())[0], path)
    return path


def _eval(exported, suite: Path, out: Path) -> list:
    return ["eval", "--checkpoint", exported, "--model", "vlp-micro", "--suite", suite, "--out", out,
            "--device", "cpu"]


def test_eval_ctrl_c_mid_suite_keeps_the_earlier_results(tiny_shards, tmp_path, exported):
    """`vlp eval` writes metrics.json and metrics.md once, when every task of the suite is done
    (vlp.eval.suite.run_eval_suite): a Ctrl-C as the second of 20 tasks starts leaves the out
    folder's earlier results byte for byte, and no partial file beside them."""
    out = tmp_path / "eval"
    short = tmp_path / "short.yaml"
    short.write_text(f"retrieval:\n  - name: earlier\n    shards: {tiny_shards['eval']}\n")
    earlier = Group(_eval(exported, short, out), tmp_path, "earlier")
    assert earlier.end(240) == 0, earlier.err()[-3000:]
    kept = {p.name: p.read_bytes() for p in out.iterdir()}
    assert sorted(kept) == ["metrics.json", "metrics.md"] and "earlier" in json.loads(kept["metrics.json"])

    suite = tmp_path / "suite.yaml"  # 20 retrieval tasks of 160 pairs, 1 image a batch, 2 loader workers
    suite.write_text("batch_size: 1\nnum_workers: 2\nretrieval:\n" + "".join(
        f"  - name: task{i}\n    shards: '{tiny_shards['train']}'\n" for i in range(20)))
    group = Group(_eval(exported, suite, out), tmp_path, "stopped")
    group.until("the second task's progress", lambda: group.err().count("embed retrieval: 0batch") >= 2)
    group.ctrl_c()
    code = group.end()
    assert _stopped_once(code, group.err()) == "vlp: interrupted (Ctrl-C); what was already written is kept"
    assert {p.name: p.read_bytes() for p in out.iterdir()} == kept
    deadline = time.time() + 30
    while not group.gone() and time.time() < deadline:
        time.sleep(0.05)
    assert group.gone(), "a loader worker outlived the stopped eval"
