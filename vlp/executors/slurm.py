"""The SLURM scheduler of vlp.executors.batch: each run one SLURM job with the resources of
grid.slurm, or its regime's own (docs/map.md, "The map on a cluster").

    sbatch --parsable --job-name=vlp-<run> --output=<logs>/slurm-%j.out ... <logs>/job.sh
    job.sh: one node, <= 1 GPU: python -m vlp.executors.job <run folder or URL>
            otherwise:         srun, one `accelerate launch -m vlp.executors.job <run>` per node

Pure functions build the sbatch line and the script and read sinfo, sacct and squeue; the class
`Slurm` runs the commands.
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable, Optional

from vlp.config import ConfigError
from vlp.executors.jobstate import DONE, FAILED, PENDING, RUNNING, JobState

SCRIPT = "job.sh"
OUTPUT = "slurm-{job}.out"  # in the run folder (or its local log folder), appended across a requeue
LOGS = "slurm-logs"  # grid.slurm.log_dir's default, under the driver's (and the jobs') working directory
WAITING = {"PENDING", "CONFIGURING", "REQUEUED", "REQUEUE_HOLD", "REQUEUE_FED", "RESIZING", "SUSPENDED", "STOPPED"}
GOING = {"RUNNING", "COMPLETING", "STAGE_OUT", "SIGNALING"}
ACCOUNTING_OFF = "accounting storage is disabled"


# ---------------------------------------------------------------------------- pure: states
def phase_of(state: str) -> str:
    """The driver's phase of a SLURM state word ('CANCELLED by 0' reads as CANCELLED)."""
    word = state.split()[0] if state.strip() else "UNKNOWN"
    if word in WAITING:
        return PENDING
    if word in GOING:
        return RUNNING
    return DONE if word == "COMPLETED" else FAILED


def exit_code_of(text: str) -> Optional[int]:
    """SLURM's 'code:signal' (or a bare code) -> the code; None when absent."""
    head = text.strip().split(":")[0]
    return int(head) if head.isdigit() else None


def parse_sacct(text: str) -> dict[str, JobState]:
    """`sacct -X -D -n -P -o JobIDRaw,State,ExitCode,Reason` -> {id: state}: a requeued job has
    one row per start (-D), the last is the current one, the others count its requeues."""
    rows: dict[str, list[list[str]]] = {}
    for line in text.splitlines():
        parts = line.split("|")
        if len(parts) >= 4 and parts[0].strip():
            rows.setdefault(parts[0].strip(), []).append(parts)
    out = {}
    for job_id, found in rows.items():
        _, state, code, reason = found[-1][:4]
        out[job_id] = JobState(job_id, state.strip(), phase_of(state), reason.strip(), exit_code_of(code),
                               requeues=len(found) - 1)
    return out


def parse_squeue(text: str, ids: list[str]) -> dict[str, JobState]:
    """`squeue -h --states=all -O JobID:|,State:|,Reason:|,exit_code:|` -> {id: state}; a job of
    ``ids`` no longer in the queue (it ended more than MinJobAge ago, and no accounting keeps it)
    reads as ENDED: the run folder says how (vlp.executors.batch)."""
    out = {}
    for line in text.splitlines():
        parts = [p.strip() for p in line.split("|")]
        if len(parts) >= 3 and parts[0]:
            out[parts[0]] = JobState(parts[0], parts[1], phase_of(parts[1]), parts[2],
                                     exit_code_of(parts[3]) if len(parts) > 3 else None)
    for job_id in ids:
        out.setdefault(job_id, JobState(job_id, "ENDED", FAILED, "no longer in the queue; accounting is off"))
    return out


# ---------------------------------------------------------------------------- pure: the cluster
def partitions(sinfo: str) -> dict[str, dict]:
    """`sinfo -h -o %P|%D|%G` -> {partition: {"default", "nodes", "gpus" (most per node)}} (the
    lines of one partition, one per node state, summed)."""
    out: dict[str, dict] = {}
    for line in sinfo.splitlines():
        parts = line.strip().split("|")
        if len(parts) < 3 or not parts[0]:
            continue
        name = parts[0].rstrip("*")
        part = out.setdefault(name, {"default": False, "nodes": 0, "gpus": 0})
        part["default"] |= parts[0].endswith("*")
        part["nodes"] += int(parts[1]) if parts[1].isdigit() else 0
        gpus = [int(n) for n in re.findall(r"gpu(?::[^:,(]+)?:(\d+)", parts[2])]
        part["gpus"] = max([part["gpus"], *gpus])
    return out


def settings_problem(cfg, parts: dict[str, dict], where: str = "grid.slurm") -> Optional[str]:
    """Why one set of job resources (``where``: grid.slurm, or grid.slurm.regimes.<regime>) cannot
    run on a cluster with these partitions (one line), else None."""
    if not parts:
        return "grid.executor=slurm, but sinfo lists no partition"
    default = next((name for name, p in parts.items() if p["default"]), None)
    name = cfg.partition or default
    if name is None:
        return f"{where}.partition is unset and the cluster has no default partition: name one of " + ", ".join(parts)
    if name not in parts:
        return f"{where}.partition={name}: the cluster has no such partition (it has {', '.join(sorted(parts))})"
    part = parts[name]
    if cfg.gpus_per_node and part["gpus"] < cfg.gpus_per_node:
        have = f"{part['gpus']} GPUs per node" if part["gpus"] else "no GPUs"
        return f"{where}.gpus_per_node={cfg.gpus_per_node}, but partition {name} has {have} (sinfo's gres)"
    if cfg.nodes > part["nodes"]:
        return f"{where}.nodes={cfg.nodes}, but partition {name} has {part['nodes']} node(s)"
    return None


def resource_sets(cfg, regimes: list[str]) -> list[tuple[str, object]]:
    """(where, resources) of each distinct set of job resources that the grid's ``regimes`` ask
    for (grid.slurm.regimes.<regime> where a regime has its own, else grid.slurm), each once."""
    out: list[tuple[str, object]] = []
    for regime in regimes or [""]:
        where = f"grid.slurm.regimes.{regime}" if regime in cfg.regimes else "grid.slurm"
        resources = cfg.of_regime(regime)
        if all(resources != seen for _, seen in out):
            out.append((where, resources))
    return out


# ---------------------------------------------------------------------------- pure: a job
def sbatch_args(cfg, name: str, logs: Path, cwd: Path) -> list[str]:
    """The sbatch options of one run's job (``cfg``: its resources), the script last; ``logs``:
    the local folder of its script and output."""
    args = [f"--job-name={name}", f"--chdir={cwd}", f"--output={logs}/{OUTPUT.format(job='%j')}", "--open-mode=append",
            "--requeue", f"--nodes={cfg.nodes}", "--ntasks-per-node=1", f"--cpus-per-task={cfg.cpus_per_task}",
            f"--time={cfg.time}"]
    for option, value in (("partition", cfg.partition), ("account", cfg.account), ("qos", cfg.qos),
                          ("mem", cfg.mem), ("constraint", cfg.constraint)):
        if value is not None:
            args.append(f"--{option}={value}")
    if cfg.gpus_per_node:
        args.append(f"--gpus-per-node={cfg.gpus_per_node}")
    return [*args, *cfg.sbatch, str(logs / SCRIPT)]


LAUNCH = ('trap "" USR1 TERM; export PET_SIGNALS_TO_HANDLE=SIGINT,SIGHUP,SIGQUIT; '
          'exec "$0" -m accelerate.commands.launch --multi_gpu --mixed_precision no --dynamo_backend no '
          '--num_machines "$SLURM_NNODES" --num_processes "$((SLURM_NNODES * VLP_PROCS_PER_NODE))" '
          '--machine_rank "$SLURM_NODEID" --main_process_ip "$MASTER_ADDR" --main_process_port "$MASTER_PORT" '
          '--rdzv_backend static --same_network -m vlp.executors.job "$1"')
"""Each node's launcher, as launch/slurm.sbatch's (signals: the ranks save, the launcher outlives them)."""


def job_script(cfg, folder: str, python: str) -> str:
    """The batch script of one run's job: the run in one process (one node, at most one GPU), else
    one `accelerate launch` per node over srun, one process per GPU (one per node without GPUs, gloo)."""
    head = "#!/bin/bash\n# written by vlp compare (grid.executor: slurm); runs " + shlex.quote(str(folder)) + "\nset -euo pipefail\n"
    run = f"{shlex.quote(python)} -m vlp.executors.job {shlex.quote(str(folder))}"
    if cfg.nodes == 1 and cfg.gpus_per_node <= 1:  # one process: no launcher, as a local run
        return head + f"exec {run}\n"
    return head + "\n".join([
        'first_node=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)',
        "MASTER_ADDR=$(scontrol show node -o \"$first_node\" | tr ' ' '\\n' | sed -n 's/^NodeAddr=//p')",
        'export MASTER_ADDR=${MASTER_ADDR:-$first_node}',
        '# a port of its own per job: two jobs may share a node',
        'export MASTER_PORT=$((20000 + SLURM_JOB_ID % 20000))',
        f"export VLP_PROCS_PER_NODE={cfg.gpus_per_node or 1}",
        *(["export ACCELERATE_USE_CPU=1"] if cfg.gpus_per_node == 0 else []),
        f"srun --kill-on-bad-exit=1 --ntasks-per-node=1 bash -c {shlex.quote(LAUNCH)} "
        f"{shlex.quote(python)} {shlex.quote(str(folder))}", ""])


# ---------------------------------------------------------------------------- the commands
def _run(cmd: list[str], timeout: float = 120) -> subprocess.CompletedProcess:
    try:
        return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    except FileNotFoundError:
        raise ConfigError(f"config: grid.executor=slurm, but {cmd[0]} is not on PATH (SLURM's client commands)") from None
    except subprocess.TimeoutExpired:
        raise ConfigError(f"compare: {cmd[0]} did not answer in {timeout:.0f} s (is slurmctld up?)") from None


def _said(proc: subprocess.CompletedProcess) -> str:
    lines = [x for x in (proc.stderr or proc.stdout or "").strip().splitlines() if x.strip()]
    return lines[-1].strip() if lines else f"exit status {proc.returncode}"


class Slurm:
    """vlp.executors.batch.Scheduler for SLURM (module doc). ``run``: how a command is run (tests)."""

    name = "slurm"

    def __init__(self, cfg, python: str = sys.executable, cwd: Optional[Path] = None,
                 run: Callable[..., subprocess.CompletedProcess] = _run, say: Callable[[str], None] = print):
        self.cfg, self.python, self.cwd, self.call, self.say = cfg, python, Path(cwd or os.getcwd()), run, say
        self.accounting: Optional[bool] = None  # unknown until the first sacct

    def check(self, regimes: list[str]) -> None:
        proc = self.call(["sinfo", "-h", "-o", "%P|%D|%G"])
        if proc.returncode != 0:
            raise ConfigError(f"compare: sinfo failed: {_said(proc)}")
        parts = partitions(proc.stdout)
        for where, resources in resource_sets(self.cfg, regimes):
            why = settings_problem(resources, parts, where)
            if why:
                raise ConfigError(f"config: {why}")
            test = self.call(["sbatch", "--test-only", *sbatch_args(resources, "vlp-check", Path("/"), self.cwd)[:-1],
                              "--wrap=true"])
            if test.returncode != 0:
                raise ConfigError(f"config: {where}: sbatch refuses the jobs' resources: {_said(test)}")

    def processes(self, regime: str) -> int:
        resources = self.cfg.of_regime(regime)
        return resources.nodes * max(1, resources.gpus_per_node)

    def logs(self, folder) -> Path:
        """The local folder of a run's job script and output: the run folder, or for a run folder
        in a bucket <grid.slurm.log_dir>/<bucket>/<path> (relative: under the working directory)."""
        if not folder.remote:
            return Path(folder.url)
        root = Path(self.cfg.log_dir or LOGS)
        return (root if root.is_absolute() else self.cwd / root) / folder.url.split("://", 1)[1]

    def submit(self, folder, name: str, regime: str = "") -> str:
        resources, logs = self.cfg.of_regime(regime), self.logs(folder)
        logs.mkdir(parents=True, exist_ok=True)
        (logs / SCRIPT).write_text(job_script(resources, folder.url, self.python))
        proc = self.call(["sbatch", "--parsable", *sbatch_args(resources, name, logs, self.cwd)])
        job_id = proc.stdout.strip().split(";")[0]
        if proc.returncode != 0 or not job_id.isdigit():
            raise ConfigError(f"compare: sbatch refused {folder.url}: {_said(proc)}")
        return job_id

    def poll(self, ids: list[str]) -> dict[str, JobState]:
        if not ids:
            return {}
        if self.accounting is not False:
            proc = self.call(["sacct", "-X", "-D", "-n", "-P", "-j", ",".join(ids), "-o", "JobIDRaw,State,ExitCode,Reason"])
            if proc.returncode == 0:
                self.accounting = True
                return parse_sacct(proc.stdout)  # a job sacct has not recorded yet is absent: still pending
            if ACCOUNTING_OFF in (proc.stderr + proc.stdout).lower():
                self.accounting = False
                self.say("[compare] SLURM accounting is off (sacct: Slurm accounting storage is disabled): "
                         "job states come from squeue")
            elif self.accounting is None:
                self.accounting = False
                self.say(f"[compare] sacct failed ({_said(proc)}): job states come from squeue")
        proc = self.call(["squeue", "-h", "--states=all", "-j", ",".join(ids), "-O", "JobID:|,State:|,Reason:|,exit_code:|"])
        if proc.returncode != 0 and "invalid job id" not in _said(proc).lower():
            raise ConfigError(f"compare: squeue failed: {_said(proc)}")
        return parse_squeue(proc.stdout if proc.returncode == 0 else "", ids)

    def find(self, name: str, since: float) -> Optional[str]:
        """The newest job named ``name``: from sacct since ``since`` where accounting is on, else
        from the queue (a job that ended and left it is not found: the run is submitted again)."""
        start = time.strftime("%Y-%m-%dT%H:%M:%S", time.localtime(since - 60))
        proc = self.call(["sacct", "-X", "-n", "-P", f"--name={name}", "-S", start, "-o", "JobIDRaw"])
        if proc.returncode != 0:
            proc = self.call(["squeue", "-h", "--states=all", f"--name={name}", "-o", "%i"])
        ids = [x.strip() for x in proc.stdout.split() if x.strip().isdigit()] if proc.returncode == 0 else []
        return max(ids, key=int) if ids else None

    def output(self, folder, job_id: str) -> Path:
        return self.logs(folder) / OUTPUT.format(job=job_id)

    def cancel(self, ids: list[str]) -> None:
        if ids:
            proc = self.call(["scancel", *ids])
            if proc.returncode != 0:
                raise ConfigError(f"compare: scancel failed: {_said(proc)}")
