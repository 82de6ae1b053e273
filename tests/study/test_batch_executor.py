"""The batch executor's driver loop (vlp/study/batch.py, with jobfiles.py and status.py) against a
fake scheduler, and the SLURM scheduler's pure parts (vlp/study/slurm.py): the sbatch line and script, sinfo / sacct / squeue
read, the settings refused. In-process and fast; the real cluster: tests/study/test_slurm_map.py."""
import json
from pathlib import Path
from types import SimpleNamespace

import pytest

from vlp.config import ConfigError, read_grid
from vlp.study import jobfiles, slurm, status
from vlp.study.batch import BatchExecutor
from vlp.study.jobstate import DONE, FAILED, PENDING, RUNNING, JobState
from vlp.study.executor import Job


class FakeScheduler:
    """Jobs that end at the next poll: as ``plan`` says per run (a list of outcomes, one per
    submission: 'ok' writes result.json and an ok compare.json; a state word fails the job)."""

    name = "fake"

    def __init__(self, plan: dict[str, list[str]]):
        self.plan, self.submitted, self.folders, self.cancelled, self.polls = plan, [], {}, [], []
        self.named: dict[str, str] = {}  # job name -> id: what find() knows

    def check(self):
        pass

    def submit(self, folder: Path, name: str) -> str:
        job_id = str(100 + len(self.submitted))
        self.submitted.append((folder.name, job_id))
        self.folders[job_id] = folder
        return job_id

    def poll(self, ids):
        self.polls.append(list(ids))
        out = {}
        for job_id in ids:
            folder = self.folders[job_id]
            outcome = self.plan[folder.name].pop(0)
            if outcome == "ok":
                (folder / "result.json").write_text("{}")
                (folder / "compare.json").write_text(json.dumps({"status": "ok", "error": "", "wall_time_s": 1.0}))
                out[job_id] = JobState(job_id, "COMPLETED", DONE)
            elif outcome == "run":
                out[job_id] = JobState(job_id, "RUNNING", RUNNING)
                self.plan[folder.name].insert(0, "ok")
            else:
                code = 2 if outcome == "CONFIG" else 1
                out[job_id] = JobState(job_id, "FAILED" if outcome == "CONFIG" else outcome, FAILED, "NonZeroExitCode", code)
        return out

    def cancel(self, ids):
        self.cancelled += ids

    def output(self, folder, job_id):
        return folder / f"out-{job_id}"

    def find(self, name, since):
        return self.named.get(name)


def grid_of(out: Path, **slurm_keys):
    return read_grid({"losses": ["infonce"], "batch_per_device": [8], "seeds": [0], "out_dir": str(out),
                      "executor": "slurm", "slurm": {"poll_s": 0.2, **slurm_keys}})


def jobs_of(out: Path, names: list[str]) -> list[Job]:
    """Jobs whose config says only where the run goes (all the executor reads of it)."""
    return [Job(SimpleNamespace(name=n), SimpleNamespace(train=SimpleNamespace(output_dir=str(out / n)),
                                                         to_dict=lambda: {"x": 1})) for n in names]


def drive(tmp_path, plan, names, **kw):
    grid = grid_of(tmp_path, **kw)
    fake = FakeScheduler(plan)
    done = []
    BatchExecutor(grid, fake, sleep=lambda s: None).run(jobs_of(tmp_path, names), on_done=lambda j, r: done.append(
        (j.run.name, r["status"])))
    return fake, sorted(done)


def test_runs_are_submitted_polled_together_and_resubmitted_up_to_the_retries(tmp_path, capsys):
    fake, done = drive(tmp_path, {"a": ["run", "ok"], "b": ["TIMEOUT", "NODE_FAIL", "ok"], "c": ["OUT_OF_MEMORY", "ok"]},
                       ["a", "b", "c"], max_in_flight=2)
    assert done == [("a", "ok"), ("b", "failed"), ("c", "ok")]
    assert all(len(p) <= 2 for p in fake.polls) and [len(p) for p in fake.polls][0] == 2  # one call per round
    record = json.loads((tmp_path / "b" / "compare.json").read_text())
    assert record["status"] == "failed" and record["error"].startswith("2 attempts, the last job ") \
        and "NODE_FAIL (NonZeroExitCode)" in record["error"], record
    text = capsys.readouterr().out
    assert "b: job 101 TIMEOUT (NonZeroExitCode); resubmitted (retry 1 of 1)" in text, text
    assert [s["state"] for s in json.loads((tmp_path / "b" / "job.json").read_text())["jobs"]] == ["TIMEOUT", "NODE_FAIL"]
    assert json.loads((tmp_path / "a" / "job_spec.json").read_text())["run"] == "a"


def test_a_config_error_in_the_job_is_not_retried(tmp_path):
    fake, done = drive(tmp_path, {"a": ["CONFIG", "ok"]}, ["a"])
    assert done == [("a", "failed")] and len(fake.submitted) == 1


def test_a_rerun_reattaches_to_the_jobs_in_flight_and_submits_no_run_twice(tmp_path, capsys):
    (tmp_path / "a").mkdir()
    jobfiles.write_submissions(tmp_path / "a", "fake", [{"id": "7", "submitted": 0}])
    fake = FakeScheduler({"a": ["run", "ok"], "b": ["ok"]})
    fake.folders["7"] = tmp_path / "a"
    BatchExecutor(grid_of(tmp_path), fake, sleep=lambda s: None).run(jobs_of(tmp_path, ["a", "b"]))
    assert [name for name, _ in fake.submitted] == ["b"]
    assert "re-attached to 1 submitted job(s): 7" in capsys.readouterr().out
    assert [j["id"] for j in json.loads((tmp_path / "a" / "job.json").read_text())["jobs"]] == ["7"]


@pytest.mark.parametrize("known", [True, False])
def test_a_submission_whose_id_was_not_recorded_is_found_by_name_or_submitted_again(tmp_path, capsys, known):
    """The driver killed between asking the scheduler and writing the id: job.json holds the job's
    name only. Found by that name: re-attached; not found (the scheduler never took it): submitted."""
    folder = tmp_path / "a"
    folder.mkdir()
    name = jobfiles.job_name("a", folder)
    jobfiles.write_submissions(folder, "fake", [{"name": name, "submitted": 0}])
    fake = FakeScheduler({"a": ["run", "ok"]})
    if known:
        fake.named[name], fake.folders["7"] = "7", folder
    BatchExecutor(grid_of(tmp_path), fake, sleep=lambda s: None).run(jobs_of(tmp_path, ["a"]))
    ids = [j["id"] for j in json.loads((folder / "job.json").read_text())["jobs"]]
    assert (ids, fake.submitted) == ((["7"], []) if known else (["100"], [("a", "100")]))
    assert ("found its job 7 by name" in capsys.readouterr().out) == known


def test_a_rerun_with_another_config_does_not_reattach(tmp_path):
    (tmp_path / "a").mkdir()
    jobfiles.write_submissions(tmp_path / "a", "fake", [{"id": "7", "submitted": 0}])
    (tmp_path / "a" / "job_spec.json").write_text(json.dumps({"run": "a", "config": {"x": 2}}))
    with pytest.raises(ConfigError, match=r"a's job 7 was submitted with another config \(x: 2 then, 1 now\)"):
        BatchExecutor(grid_of(tmp_path), FakeScheduler({}), sleep=lambda s: None).run(jobs_of(tmp_path, ["a"]))


def test_status_rows_and_cancel(tmp_path):
    for name, jobs in (("a", [{"id": "1", "state": "COMPLETED"}]), ("b", [{"id": "2"}]), ("c", [{"id": "3"}]),
                       ("d", [{"id": "4", "state": "TIMEOUT", "reason": "TimeLimit"}])):
        (tmp_path / name).mkdir()
        jobfiles.write_submissions(tmp_path / name, "fake", jobs)
    (tmp_path / "a" / "result.json").write_text("{}")
    states = {"2": JobState("2", "PENDING", PENDING, "Priority", requeues=2), "3": JobState("3", "RUNNING", RUNNING)}
    rows = status.status_rows(status.run_folders(tmp_path), states)
    assert [r[:2] for r in rows] == [("a", "done"), ("b", "requeued 2"), ("c", "running"), ("d", "failed")]
    assert "TIMEOUT TimeLimit" in rows[3][3]
    assert status.status_table(rows).endswith("1 done, 1 failed, 1 requeued, 1 running")
    fake = FakeScheduler({})
    assert status.cancel_study(SimpleNamespace(out_dir=str(tmp_path)), fake) == 2 and fake.cancelled == ["2", "3"]


def test_sacct_and_squeue_are_read_with_requeues_and_vanished_jobs():
    states = slurm.parse_sacct("5|REQUEUED|0:0|None\n5|PENDING|0:0|BeginTime\n6|CANCELLED by 0|0:15|None\n"
                               "7|FAILED|2:0|NonZeroExitCode\n")
    assert states["5"].phase == PENDING and states["5"].requeues == 1
    assert states["6"].phase == FAILED and states["7"].exit_code == 2
    q = slurm.parse_squeue("8|RUNNING|None|0|\n", ["8", "9"])
    assert q["8"].phase == RUNNING and q["9"].state == "ENDED" and q["9"].phase == FAILED
    assert [slurm.phase_of(s) for s in ("COMPLETING", "COMPLETED", "OUT_OF_MEMORY", "SUSPENDED")] == [
        RUNNING, DONE, FAILED, PENDING]


def test_the_cluster_settings_refused_in_one_line():
    parts = slurm.partitions("main*|1|(null)\nmain*|1|(null)\ngpu|4|gpu:h100:8(S:0-1)\n")
    assert parts == {"main": {"default": True, "nodes": 2, "gpus": 0}, "gpu": {"default": False, "nodes": 4, "gpus": 8}}
    cfg = lambda **kw: read_grid({"losses": ["infonce"], "batch_per_device": [8], "seeds": [0], "slurm": kw}).slurm
    assert slurm.settings_problem(cfg(), parts) is None
    assert slurm.settings_problem(cfg(partition="gpu", gpus_per_node=8, nodes=4), parts) is None
    assert "no such partition" in slurm.settings_problem(cfg(partition="x"), parts)
    assert "has no GPUs" in slurm.settings_problem(cfg(gpus_per_node=1), parts)
    assert "8 GPUs per node" in slurm.settings_problem(cfg(partition="gpu", gpus_per_node=16), parts)
    assert "has 2 node(s)" in slurm.settings_problem(cfg(nodes=3), parts)


def test_the_sbatch_line_and_the_job_script(tmp_path):
    cfg = read_grid({"losses": ["infonce"], "batch_per_device": [8], "seeds": [0], "slurm": {
        "partition": "gpu", "gpus_per_node": 8, "nodes": 2, "mem": "256G", "time": 90, "sbatch": ["--exclusive"]}}).slurm
    args = slurm.sbatch_args(cfg, "vlp-a", tmp_path / "a b", tmp_path)
    assert args[-2:] == ["--exclusive", str(tmp_path / "a b" / "job.sh")]
    assert {"--partition=gpu", "--gpus-per-node=8", "--nodes=2", "--mem=256G", "--time=90", "--requeue"} <= set(args)
    script = slurm.job_script(cfg, tmp_path / "a b", "/venv/bin/python")
    assert "srun --kill-on-bad-exit=1" in script and "VLP_PROCS_PER_NODE=8" in script and "ACCELERATE_USE_CPU" not in script
    one = slurm.job_script(read_grid({"losses": ["infonce"], "batch_per_device": [8], "seeds": [0]}).slurm,
                           tmp_path / "a b", "/venv/bin/python")
    assert one.rstrip().endswith(f"exec /venv/bin/python -m vlp.study.job '{tmp_path / 'a b'}'")


def test_a_failed_poll_is_one_line_and_polled_again(tmp_path, capsys):
    grid, fake = grid_of(tmp_path), FakeScheduler({"a": ["ok"]})
    errors, real = [ConfigError("compare: squeue failed: timeout")], fake.poll

    def flaky(ids):  # the first poll fails, the next ones answer
        if errors:
            raise errors.pop()
        return real(ids)

    fake.poll = flaky
    BatchExecutor(grid, fake, sleep=lambda s: None).run(jobs_of(tmp_path, ["a"]))
    assert "squeue failed: timeout; polling again in 0.2 s" in capsys.readouterr().out


def test_a_bucket_out_dir_is_refused_for_a_scheduler(tmp_path):
    with pytest.raises(ConfigError, match="grid.out_dir on a file system the jobs share"):
        BatchExecutor(grid_of("s3://b/grid"), FakeScheduler({}))
