"""The batch executor's driver loop (vlp/executors/batch.py, with jobfiles.py and status.py) against a
fake scheduler, and the SLURM scheduler's pure parts (vlp/executors/slurm.py): the sbatch line and script, sinfo / sacct / squeue
read, the settings refused. In-process and fast; the real cluster: tests/study/test_slurm_map.py."""
import csv
import json
import re
import subprocess
from pathlib import Path
from types import SimpleNamespace

import pytest

from vlp.checkpoint.storage import RunFolder
from vlp.config import ConfigError, read_grid
from vlp.study.compare import load_compare_config
from vlp.study.grid import parse_grid
from vlp.executors import jobfiles, slurm, status
from vlp.executors.batch import BatchExecutor
from vlp.executors.jobstate import DONE, FAILED, PENDING, RUNNING, JobState
from vlp.executors import Job
from vlp_testing import REPO


class FakeScheduler:
    """Jobs that end at the next poll: as ``plan`` says per run (a list of outcomes, one per
    submission: 'ok' writes result.json and an ok compare.json; a state word fails the job)."""

    name = "fake"

    def __init__(self, plan: dict[str, list[str]]):
        self.plan, self.submitted, self.folders, self.cancelled, self.polls = plan, [], {}, [], []
        self.named: dict[str, str] = {}  # job name -> id: what find() knows
        self.regimes: dict[str, str] = {}  # run folder -> the regime it was submitted with
        self.checked: list = []

    def check(self, regimes):
        self.checked.append(list(regimes))

    def processes(self, regime):
        return 1

    def submit(self, folder, name: str, regime: str = "") -> str:
        job_id = str(100 + len(self.submitted))
        name = Path(folder.url).name
        self.submitted.append((name, job_id))
        self.folders[job_id], self.regimes[name] = Path(folder.url), regime
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
        return Path(folder.url) / f"out-{job_id}"

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


class Killed(BaseException):
    """The driver's process killed (SIGKILL) where this is raised: nothing of it runs after."""


@pytest.mark.parametrize("stop", ["SIGKILL", "Ctrl-C"])
def test_a_rerun_of_the_driver_does_not_reset_the_retry_budget(tmp_path, monkeypatch, capsys, stop):
    """`vlp compare` (in this process, the fake scheduler its cluster) on a run that always fails,
    grid.retries=2: the driver is stopped after the run's first failure (its retry in flight), then
    run again, twice. In all the run is submitted 1 + grid.retries times; the rerun counts on from
    job.json ("retry 2 of 2"), reports the cell missing with its reason and exits 1; the third
    driver submits nothing and says why; with the run's config edited, its count starts afresh."""
    from vlp import cli
    from vlp.executors import batch
    from vlp.study import plots

    for figure in ("plot_curves", "plot_metric_vs_batch"):  # the report's tables are read; its figures cost seconds
        monkeypatch.setattr(plots, figure, lambda *a, **k: None)
    fake = FakeScheduler({"infonce_b8_s0": ["FAILED"] * 9})
    polls, real = [], fake.poll

    def poll(ids):  # the second poll: the driver dies (or is Ctrl-C'd) while job 101, the retry, is in flight
        polls.append(ids)
        if len(polls) == 2:
            raise Killed() if stop == "SIGKILL" else KeyboardInterrupt()
        return real(ids)

    fake.poll = poll
    monkeypatch.setattr(batch, "scheduler_of", lambda grid: fake)
    out = tmp_path / "grid"
    config = tmp_path / "compare.yaml"
    config.write_text(json.dumps({
        "model": {"name": "vlp-micro"}, "data": {"train_shards": str(tmp_path / "train-{0..1}.tar")},
        "grid": {"losses": ["infonce"], "batch_per_device": [8], "seeds": [0], "out_dir": str(out), "retries": 2,
                 "executor": "slurm", "slurm": {"poll_s": 0.2}}}))
    argv = ["compare", "-c", str(config)]
    if stop == "SIGKILL":
        with pytest.raises(Killed):
            cli.main(argv)
    else:
        assert cli.main(argv) == 130
    first = capsys.readouterr()
    assert "job 100 FAILED (NonZeroExitCode); resubmitted (retry 1 of 2)" in first.out, first.out
    assert fake.submitted == [("infonce_b8_s0", "100"), ("infonce_b8_s0", "101")]

    assert cli.main(argv) == 1
    again = capsys.readouterr()
    assert "re-attached to 1 submitted job(s): 101" in again.out, again.out
    assert "job 101 FAILED (NonZeroExitCode); resubmitted (retry 2 of 2)" in again.out, again.out
    assert [i for _, i in fake.submitted] == ["100", "101", "102"]  # 1 + grid.retries, across both drivers
    record = json.loads((out / "infonce_b8_s0" / "compare.json").read_text())
    assert record["status"] == "failed" and record["attempts"] == 3, record
    assert record["error"] == "3 attempts, the last job 102 FAILED (NonZeroExitCode)", record
    (error,) = [x for x in again.err.splitlines() if x.startswith("vlp: error:")]
    assert "1 run(s) failed after grid.retries (infonce_b8_s0)" in error, again.err
    assert f"Failed runs: infonce_b8_s0 ({record['error']})" in (out / "results.md").read_text()
    with open(out / "runs.csv") as f:
        assert [(r["run"], r["status"]) for r in csv.DictReader(f)] == [("infonce_b8_s0", "failed")]

    assert cli.main(argv) == 1  # a third driver: the attempts are spent, nothing is submitted
    third = capsys.readouterr()
    assert len(fake.submitted) == 3 and "1 run(s) failed after grid.retries" in third.err, third.err
    assert ("infonce_b8_s0: 3 failed attempts in its job.json spent grid.retries=2; not submitted again "
            "(raise grid.retries, or delete its job.json, to retry it)") in third.out, third.out
    assert json.loads((out / "infonce_b8_s0" / "compare.json").read_text()) == record
    assert [j.get("failed") for j in json.loads((out / "infonce_b8_s0" / "job.json").read_text())["jobs"]] == [True] * 3

    assert cli.main([*argv, "optim.lr=0.004"]) == 1  # the config edited: a fresh count of attempts
    fourth = capsys.readouterr()
    assert [i for _, i in fake.submitted] == ["100", "101", "102", "103", "104", "105"], fourth.out
    assert json.loads((out / "infonce_b8_s0" / "compare.json").read_text())["error"].startswith("3 attempts, the last job 105")


def test_a_config_error_in_the_job_is_not_retried(tmp_path):
    fake, done = drive(tmp_path, {"a": ["CONFIG", "ok"]}, ["a"])
    assert done == [("a", "failed")] and len(fake.submitted) == 1


def test_a_rerun_reattaches_to_the_jobs_in_flight_and_submits_no_run_twice(tmp_path, capsys):
    jobfiles.write_submissions(RunFolder(tmp_path / "a"), "fake", [{"id": "7", "submitted": 0}])
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
    name = jobfiles.job_name("a", RunFolder(folder))
    jobfiles.write_submissions(RunFolder(folder), "fake", [{"name": name, "submitted": 0}])
    fake = FakeScheduler({"a": ["run", "ok"]})
    if known:
        fake.named[name], fake.folders["7"] = "7", folder
    BatchExecutor(grid_of(tmp_path), fake, sleep=lambda s: None).run(jobs_of(tmp_path, ["a"]))
    ids = [j["id"] for j in json.loads((folder / "job.json").read_text())["jobs"]]
    assert (ids, fake.submitted) == ((["7"], []) if known else (["100"], [("a", "100")]))
    assert ("found its job 7 by name" in capsys.readouterr().out) == known


def test_a_rerun_with_another_config_does_not_reattach(tmp_path):
    jobfiles.write_submissions(RunFolder(tmp_path / "a"), "fake", [{"id": "7", "submitted": 0}])
    (tmp_path / "a" / "job_spec.json").write_text(json.dumps({"run": "a", "config": {"x": 2}}))
    with pytest.raises(ConfigError, match=r"a's job 7 was submitted with another config \(x: 2 then, 1 now\)"):
        BatchExecutor(grid_of(tmp_path), FakeScheduler({}), sleep=lambda s: None).run(jobs_of(tmp_path, ["a"]))


def test_status_rows_and_cancel(tmp_path):
    for name, jobs in (("a", [{"id": "1", "state": "COMPLETED"}]), ("b", [{"id": "2"}]), ("c", [{"id": "3"}]),
                       ("d", [{"id": "4", "state": "TIMEOUT", "reason": "TimeLimit"}])):
        jobfiles.write_submissions(RunFolder(tmp_path / name), "fake", jobs)
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
    assert one.rstrip().endswith(f"exec /venv/bin/python -m vlp.executors.job '{tmp_path / 'a b'}'")


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



# ---------------------------------------------------------------------------- a regime's own resources
def regimes_grid(**slurm_keys):
    """A study with a scratch and a lit regime, grid.slurm giving a scratch run a node of 8 GPUs."""
    return parse_grid({"losses": ["infonce"], "batch_per_device": [8], "seeds": [0], "sweep": {"optim.lr": [1e-3]},
                       "regimes": {"scratch": {}, "lit": {"model.lock_image": True}, "big": False},
                       "executor": "slurm", "slurm": {"partition": "gpu", "gpus_per_node": 8, "time": 600,
                                                      "sbatch": ["--exclusive"], **slurm_keys}})


class Answers:
    """A `run` for slurm.Slurm: sinfo's partitions, sbatch's id; every command kept."""

    def __init__(self, sinfo="main*|2|(null)\ngpu|4|gpu:h100:8(S:0-1)\n"):
        self.sinfo, self.calls = sinfo, []

    def __call__(self, cmd, timeout=120):
        self.calls.append(cmd)
        return subprocess.CompletedProcess(cmd, 0, self.sinfo if cmd[0] == "sinfo" else "42\n", "")


def test_a_regime_has_job_resources_of_its_own_and_a_world_of_its_own(tmp_path):
    """grid.slurm.regimes.lit: a LiT run on 1 GPU for 30 minutes, without --exclusive; the keys it
    leaves out (partition) are grid.slurm's; a regime without an entry gets grid.slurm's node."""
    grid = regimes_grid(regimes={"lit": {"gpus_per_node": 1, "time": 30, "sbatch": []}})
    lit, scratch = grid.slurm.of_regime("lit"), grid.slurm.of_regime("scratch")
    assert (lit.partition, lit.gpus_per_node, lit.time, lit.sbatch, lit.nodes) == ("gpu", 1, 30, [], 1)
    assert (scratch.gpus_per_node, scratch.time, scratch.sbatch) == (8, 600, ["--exclusive"])
    answers = Answers()
    sched = slurm.Slurm(grid.slurm, python="/venv/bin/python", cwd=tmp_path, run=answers)
    sched.submit(RunFolder(tmp_path / "a"), "vlp-a", "lit")
    sched.submit(RunFolder(tmp_path / "b"), "vlp-b", "scratch")
    a, b = answers.calls
    assert {"--gpus-per-node=1", "--time=30", "--partition=gpu"} <= set(a) and "--exclusive" not in a
    assert {"--gpus-per-node=8", "--time=600", "--exclusive"} <= set(b)
    assert (tmp_path / "a" / "job.sh").read_text().rstrip().endswith(f"-m vlp.executors.job {tmp_path / 'a'}")
    assert "VLP_PROCS_PER_NODE=8" in (tmp_path / "b" / "job.sh").read_text()
    ex = BatchExecutor(grid, sched)
    assert (ex.world_of("lit"), ex.world_of("scratch")) == (1, 8)  # each run's global batch follows its job


def test_a_run_folder_in_a_bucket_keeps_its_script_and_output_in_a_local_folder(tmp_path):
    """SLURM writes --output to a file system: slurm-logs/<bucket>/<path>/<run> under the working
    directory (the jobs' --chdir), or under grid.slurm.log_dir; the job gets the run's URL."""
    grid = grid_of(tmp_path)
    folder = RunFolder("s3://bucket/grid/a")
    answers = Answers()
    sched = slurm.Slurm(grid.slurm, python="/venv/bin/python", cwd=tmp_path, run=answers)
    logs = tmp_path / "slurm-logs" / "bucket" / "grid" / "a"
    assert sched.logs(folder) == logs and sched.output(folder, "42") == logs / "slurm-42.out"
    sched.submit(folder, "vlp-a")
    (cmd,) = answers.calls
    assert f"--output={logs}/slurm-%j.out" in cmd and cmd[-1] == str(logs / "job.sh")
    assert (logs / "job.sh").read_text().rstrip().endswith("-m vlp.executors.job s3://bucket/grid/a")
    elsewhere = slurm.Slurm(grid_of(tmp_path, log_dir="/shared/logs").slurm, cwd=tmp_path)
    assert elsewhere.logs(folder) == Path("/shared/logs/bucket/grid/a")
    assert elsewhere.logs(RunFolder(tmp_path / "a")) == tmp_path / "a"  # a local run folder keeps them
    with pytest.raises(ConfigError, match=r"grid.slurm.log_dir must be a local folder \(a path, not a URL\)"):
        grid_of(tmp_path, log_dir="s3://b/logs")


def test_every_set_of_resources_is_checked_before_anything_is_submitted():
    """One sinfo, then each distinct set once (sbatch --test-only); a regime's set the cluster
    cannot run is one line naming its entry."""
    grid = regimes_grid(regimes={"lit": {"gpus_per_node": 1}})
    answers = Answers()
    slurm.Slurm(grid.slurm, run=answers).check(list(grid.regimes))
    tests = [c for c in answers.calls if "--test-only" in c]
    assert [c[0] for c in answers.calls].count("sinfo") == 1 and len(tests) == 2
    assert [next(a for a in c if a.startswith("--gpus-per-node")) for c in tests] == ["--gpus-per-node=8",
                                                                                       "--gpus-per-node=1"]
    same = regimes_grid(regimes={"lit": {"time": 600}})  # the same set as grid.slurm's: checked once
    answers = Answers()
    slurm.Slurm(same.slurm, run=answers).check(list(same.regimes))
    assert len([c for c in answers.calls if "--test-only" in c]) == 1
    bad = regimes_grid(regimes={"lit": {"partition": "main", "gpus_per_node": 1}})
    with pytest.raises(ConfigError, match=r"^config: grid.slurm.regimes.lit.gpus_per_node=1, but partition main "
                                          r"has no GPUs \(sinfo's gres\)$"):
        slurm.Slurm(bad.slurm, run=Answers()).check(list(bad.regimes))
    fake = FakeScheduler({})
    BatchExecutor(grid, fake, sleep=lambda s: None).run([])
    assert fake.checked == [["scratch", "lit"]]


@pytest.mark.parametrize("regimes, message", [
    ({"lti": {"gpus_per_node": 1}}, "config: grid.slurm.regimes.lti: no such regime in grid.regimes (it has scratch, "
                                    "lit, big)"),
    ({"lit": {"gpus": 1}}, "config: unknown key 'grid.slurm.regimes.lit.gpus' (valid: account, constraint, "),
    ({"lit": {"nodes": 0}}, "config: grid.slurm.regimes.lit.nodes must be > 0, got 0"),
    ({"lit": {"mem": "lots"}}, "config: grid.slurm.regimes.lit.mem must be a SLURM memory size"),
    ({"lit": {"time": "long"}}, "config: grid.slurm.regimes.lit.time must be int, got str 'long'"),
    ({"lit": 1}, "config: grid.slurm.regimes entry lit must map resource keys"),
])
def test_a_bad_regime_entry_is_one_line(regimes, message):
    with pytest.raises(ConfigError) as e:
        regimes_grid(regimes=regimes)
    assert str(e.value).startswith(message) and "\n" not in str(e.value), str(e.value)


def test_a_regime_left_out_may_keep_its_resources_and_a_plain_grid_has_no_regimes():
    assert regimes_grid(regimes={"big": {"nodes": 4}}).slurm.of_regime("big").nodes == 4
    with pytest.raises(ConfigError, match=r"grid.slurm.regimes.lit: no such regime in grid.regimes \(the grid has none\)"):
        parse_grid({"losses": ["infonce"], "batch_per_device": [8], "seeds": [0], "slurm": {"regimes": {"lit": {}}}})


def test_the_gpu_configs_slurm_section_gives_lit_one_gpu(tmp_path):
    """configs/compare_gpu_vitb32.yaml's commented slurm section, uncommented, parses: lit on 1 GPU."""
    text = (REPO / "configs" / "compare_gpu_vitb32.yaml").read_text()
    head, mark, tail = text.partition("  # executor: slurm")
    config = tmp_path / "gpu.yaml"
    config.write_text(head + re.sub(r"(?m)^  # ", "  ", mark + tail))
    _, grid = load_compare_config(config)
    assert grid.executor == "slurm" and grid.slurm.of_regime("scratch").gpus_per_node == 8
    lit = grid.slurm.of_regime("lit")
    assert (lit.gpus_per_node, lit.sbatch, lit.partition) == (1, [], "gpu")


# ---------------------------------------------------------------------------- the feature-cache warm-up job
def warm_bases(tmp_path) -> dict:
    """regime_bases' shape: lit caches its locked towers' features in a folder, scratch caches nothing."""
    lit = {"model": {"name": "vlp-micro", "lock_image": True, "lock_text": True},
           "data": {"train_shards": "s", "train_transform": "eval", "feature_cache": str(tmp_path / "features")}}
    specs = {"val": "v", "test": "t"}
    return {("", "lit"): (lit, specs), ("", "scratch"): ({"model": {"name": "vlp-micro"}}, specs)}


def regime_jobs(out: Path, runs: dict[str, str]) -> list[Job]:
    """jobs_of, each run of a regime ({run: regime})."""
    return [Job(SimpleNamespace(name=n, arm=SimpleNamespace(regime=r, table=("", r))),
                SimpleNamespace(train=SimpleNamespace(output_dir=str(out / n)), to_dict=lambda: {"x": 1}))
            for n, r in runs.items()]


def warm_drive(tmp_path, plan, runs, reattach: dict[str, str] = ()):
    fake, done = FakeScheduler(plan), []
    for name, job_id in dict(reattach).items():  # a driver before this one submitted these
        jobfiles.write_submissions(RunFolder(tmp_path / name), "fake", [{"id": job_id, "submitted": 0}])
        fake.folders[job_id] = tmp_path / name
    ex = BatchExecutor(grid_of(tmp_path), fake, sleep=lambda s: None)
    ex.warm(warm_bases(tmp_path))
    ex.run(regime_jobs(tmp_path, runs), on_done=lambda j, r: done.append((j.run.name, r["status"])))
    return fake, sorted(done)


def test_a_regimes_warm_up_is_a_job_before_its_runs(tmp_path, capsys):
    """The driver computes no feature: lit's caches are one job (the regime's resources) in
    warm_lit/; lit's runs are submitted once it is done, scratch's at once; a rerun does not warm again."""
    fake, done = warm_drive(tmp_path, {"warm_lit": ["run", "ok"], "a": ["ok"], "b": ["ok"], "s": ["ok"]},
                            {"a": "lit", "b": "lit", "s": "scratch"})
    assert [name for name, _ in fake.submitted] == ["warm_lit", "s", "a", "b"] and done == [
        ("a", "ok"), ("b", "ok"), ("s", "ok")]
    assert fake.polls[0] == ["100", "101"] and fake.regimes == {"warm_lit": "lit", "a": "lit", "b": "lit", "s": "scratch"}
    spec = json.loads((tmp_path / "warm_lit" / "job_spec.json").read_text())
    assert spec["warm"] is True and spec["config"]["data"]["feature_cache"] == str(tmp_path / "features")
    assert spec["config"]["train"]["output_dir"] == str(tmp_path / "warm_lit") and spec["specs"]["val"] == "v"
    assert "warm_lit: feature caches built (job 100); its runs go next" in capsys.readouterr().out
    again, _ = warm_drive(tmp_path, {"c": ["ok"]}, {"c": "lit"})
    assert [name for name, _ in again.submitted] == ["c"]
    assert "warm_lit: the feature caches were built before" in capsys.readouterr().out


def test_a_warm_up_that_fails_is_retried_then_fails_its_runs_with_its_reason(tmp_path):
    fake, done = warm_drive(tmp_path, {"warm_lit": ["OUT_OF_MEMORY", "NODE_FAIL"], "s": ["ok"]},
                            {"a": "lit", "s": "scratch"})
    assert [name for name, _ in fake.submitted] == ["warm_lit", "s", "warm_lit"]  # grid.retries: 1
    assert done == [("a", "failed"), ("s", "ok")]
    record = json.loads((tmp_path / "a" / "compare.json").read_text())
    assert record["error"].startswith("its feature-cache warm-up warm_lit failed: 2 attempts, the last job 102 "
                                      "NODE_FAIL"), record
    again, done = warm_drive(tmp_path, {}, {"a": "lit"})  # a later driver: its attempts spent (job.json), not submitted
    assert again.submitted == [] and done == [("a", "failed")]
    assert json.loads((tmp_path / "a" / "compare.json").read_text()) == record


def test_a_warm_up_in_flight_is_reattached(tmp_path, capsys):
    """Its id recorded as a run's (job.json): a restarted driver waits for it, submits it no more."""
    fake, done = warm_drive(tmp_path, {"warm_lit": ["run", "ok"], "a": ["ok"]}, {"a": "lit"}, reattach={"warm_lit": "7"})
    assert [name for name, _ in fake.submitted] == ["a"] and done == [("a", "ok")]
    assert "re-attached to 1 submitted job(s): 7" in capsys.readouterr().out


def test_a_job_spec_names_its_work_in_vlp_or_is_one_line():
    """job_spec.json's "work": a vlp function by name; none (a spec from before the field) is a run's
    training; anything else is one ConfigError line (the job exits 2, not retried), never None."""
    from vlp.study.runs import train_job

    assert jobfiles.work_named("vlp.study.runs:train_job") is train_job
    assert jobfiles.work_named(None) is train_job
    for bad in ("os:system", "vlp.study.runs:nothing", "vlp.nowhere:f", "vlp.study.runs"):
        with pytest.raises(ConfigError, match="names its work"):
            jobfiles.work_named(bad)
