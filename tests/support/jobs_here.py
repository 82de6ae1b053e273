"""SLURM's commands answered in this process, for the SLURM scheduler class (vlp.executors.slurm.Slurm)
with real jobs and no cluster: `sbatch` runs the job at once, here, as the job script would
(`python -m vlp.executors.job ARG`: vlp.executors.job.main([ARG])), and `sacct` answers with how it exited.

    here = JobsHere()
    monkeypatch.setattr(batch, "scheduler_of", lambda grid: Slurm(grid.slurm, cwd=tmp_path, run=here))

Cheap where the loopback cluster is not (tests/study/test_slurm_map.py): no job process imports
torch again. What it leaves out is SLURM itself: the queue, the nodes, the output file."""

from __future__ import annotations

import shlex
import subprocess
from pathlib import Path


class JobsHere:
    """A `run` for vlp.executors.slurm.Slurm; ``calls``: every command, ``jobs``: id -> (exit status,
    the job's argument, its script's folder)."""

    def __init__(self, sinfo: str = "main*|2|(null)\n"):
        self.sinfo, self.calls, self.jobs = sinfo, [], {}

    def __call__(self, cmd: list[str], timeout: float = 120) -> subprocess.CompletedProcess:
        from vlp.executors import job

        self.calls.append(cmd)
        out = ""
        if cmd[0] == "sinfo":
            out = self.sinfo
        elif cmd[0] == "sbatch" and "--test-only" not in cmd:
            script = Path(cmd[-1])
            arg = shlex.split(script.read_text().strip().splitlines()[-1])[-1]  # exec PYTHON -m vlp.executors.job ARG
            job_id = str(len(self.jobs) + 1)
            self.jobs[job_id] = (job.main([arg]), arg, script.parent)
            out = f"{job_id}\n"
        elif cmd[0] == "sacct" and "-j" in cmd:
            for job_id in cmd[cmd.index("-j") + 1].split(","):
                code = self.jobs[job_id][0]
                out += f"{job_id}|{'COMPLETED' if code == 0 else 'FAILED'}|{code}:0|None\n"
        return subprocess.CompletedProcess(cmd, 0, out, "")

    def submitted(self) -> list[str]:
        """The argument (run folder or URL) of each job, in the order of their sbatch."""
        return [arg for _, arg, _ in self.jobs.values()]
