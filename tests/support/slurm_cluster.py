"""A real SLURM cluster on 127.0.0.1 for the tests: munged, slurmctld and two slurmd ("n1", "n2")
from Debian's packages (slurmctld slurmd slurm-client munge, SLURM 22.05), all state in one temp
folder, started once per session and stopped after (tests/cli/test_slurm.py).

    cluster = SlurmCluster(tmp_dir).start()
    job = cluster.sbatch(["launch/slurm.sbatch", "configs/demo.yaml", ...], env=...)
    cluster.wait(job, lambda info: info["JobState"] == "COMPLETED")
    cluster.stop()

Both nodes are this box (NodeAddr=127.0.0.1, distinct ports); their names do not resolve, as on
clusters whose node names are not in DNS. CPUs=64 per node (SlurmdParameters=config_overrides)
so the sbatch script's own #SBATCH lines are accepted as written. Two partitions: "main"
(default) and "high" (a higher PriorityTier: its jobs preempt main's with REQUEUE after GraceTime).

    SlurmCluster(tmp_dir, accounting=True).start()   # with slurmdbd on a private MariaDB: sacct works

Accounting (Debian's slurmdbd and mariadb-server): mariadbd runs with --no-defaults (nothing of
/etc/mysql) as root on a free 127.0.0.1 port, slurmdbd reads slurmdbd.conf (mode 600) beside
$SLURM_CONF (it has no -f), and slurmctld and sacct reach slurmdbd with the cluster's own munge
socket (AccountingStoragePass=socket=...: AuthInfo is not read for that link). Without it sacct
answers "Slurm accounting storage is disabled", as on many clusters.
"""
from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path

from vlp_testing import free_port

BINARIES = ("munged", "slurmctld", "slurmd", "sbatch", "scontrol", "squeue", "scancel")
PACKAGES = "slurmctld slurmd slurm-client munge"
ACCOUNTING_BINARIES = ("slurmdbd", "mariadbd", "mariadb-install-db", "sacct")
ACCOUNTING_PACKAGES = "slurmdbd mariadb-server"
SBIN = "/usr/sbin"


def missing(accounting: bool = False) -> str | None:
    """Why the cluster (with accounting: and its slurmdbd) cannot start here (None when it can)."""
    path = os.environ.get("PATH", "") + os.pathsep + SBIN
    wanted = BINARIES + (ACCOUNTING_BINARIES if accounting else ())
    absent = [b for b in wanted if shutil.which(b, path=path) is None]
    if absent:
        packages = PACKAGES + (f" {ACCOUNTING_PACKAGES}" if accounting else "")
        return f"SLURM not installed ({', '.join(absent)} missing; scripts/setup.sh installs {packages} as root)"
    return None


def free_ports(n: int) -> list[int]:
    """``n`` distinct free ports (vlp_testing.free_port: below the kernel's ephemeral range)."""
    ports: set[int] = set()
    while len(ports) < n:
        ports.add(free_port())
    return sorted(ports)


def slurm_conf(d: Path, host: str, ctld_port: int, node_ports: list[int], grace_s: int, dbd_port: int = 0) -> str:
    """slurm.conf of the cluster; ``dbd_port``: slurmdbd's port (accounting on), 0: no accounting."""
    accounting = (f"AccountingStorageType=accounting_storage/slurmdbd\nAccountingStorageHost={host}\n"
                  f"AccountingStoragePort={dbd_port}\nAccountingStoragePass=socket={d}/munge.sock\n"
                  "JobAcctGatherType=jobacct_gather/none\n") if dbd_port else ""
    nodes = "\n".join(f"NodeName=n{i + 1} NodeHostname={host} NodeAddr=127.0.0.1 Port={p} CPUs=64 "
                      f"RealMemory=4000 State=UNKNOWN" for i, p in enumerate(node_ports))
    return f"""ClusterName=vlptest
SlurmctldHost={host}(127.0.0.1)
SlurmctldPort={ctld_port}
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={d}/munge.sock
SlurmUser=root
SlurmdUser=root
StateSaveLocation={d}/state
SlurmdSpoolDir={d}/spool-%n
SlurmctldPidFile={d}/slurmctld.pid
SlurmdPidFile={d}/slurmd-%n.pid
SlurmctldLogFile={d}/slurmctld.log
SlurmdLogFile={d}/slurmd-%n.log
SlurmdDebug=debug
SlurmdParameters=config_overrides
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
MpiDefault=none
SwitchType=switch/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SchedulerType=sched/builtin
JobRequeue=1
ReturnToService=2
KillWait=10
SlurmdTimeout=10
InactiveLimit=0
MinJobAge=600
MessageTimeout=20
PreemptType=preempt/partition_prio
PreemptMode=REQUEUE
{nodes}
PartitionName=main Nodes=ALL Default=YES MaxTime=INFINITE State=UP PriorityTier=1 GraceTime={grace_s}
PartitionName=high Nodes=ALL MaxTime=INFINITE State=UP PriorityTier=10 PreemptMode=OFF
{accounting}"""


def slurmdbd_conf(d: Path, host: str, dbd_port: int, db_port: int) -> str:
    return f"""AuthType=auth/munge
AuthInfo=socket={d}/munge.sock
DbdHost={host}
DbdAddr=127.0.0.1
DbdPort={dbd_port}
SlurmUser=root
PidFile={d}/slurmdbd.pid
LogFile={d}/slurmdbd.log
StorageType=accounting_storage/mysql
StorageHost=127.0.0.1
StoragePort={db_port}
StorageUser=root
StorageLoc=slurm_acct_db
"""


class SlurmCluster:
    def __init__(self, root: Path, grace_s: int = 30, accounting: bool = False):
        self.dir = Path(root)
        self.conf = self.dir / "slurm.conf"
        self.grace_s = grace_s
        self.accounting = accounting
        self.procs: dict[str, subprocess.Popen] = {}
        self.env = dict(os.environ, SLURM_CONF=str(self.conf), PATH=os.environ.get("PATH", "") + os.pathsep + SBIN)

    # ------------------------------------------------------------------ life cycle
    def start(self) -> "SlurmCluster":
        d = self.dir
        for sub in ("state", "munge"):
            (d / sub).mkdir(parents=True, exist_ok=True)
        os.chmod(d, 0o700)
        key = d / "munge" / "munge.key"
        key.write_bytes(os.urandom(1024))
        os.chmod(key, 0o400)
        self._run(["munged", "--force", "-S", str(d / "munge.sock"), "--key-file", str(key),
                   "--pid-file", str(d / "munge" / "munged.pid"), "--log-file", str(d / "munge" / "munged.log"),
                   "--seed-file", str(d / "munge" / "munged.seed")])
        ctld, dbd, db, *nodes = free_ports(5)
        host = socket.gethostname().split(".")[0]
        if self.accounting:
            self._start_accounting(host, dbd, db)
        self.conf.write_text(slurm_conf(d, host, ctld, nodes, self.grace_s, dbd if self.accounting else 0))
        self.procs["slurmctld"] = self._daemon(["slurmctld", "-D", "-i", "-f", str(self.conf)], "slurmctld")
        for name in ("n1", "n2"):
            self.procs[name] = self._daemon(["slurmd", "-D", "-f", str(self.conf), "-N", name], f"slurmd-{name}")
        self._wait_idle(90)
        return self

    def _start_accounting(self, host: str, dbd_port: int, db_port: int) -> None:
        """A private MariaDB (its own data folder and port) and slurmdbd on it, up before slurmctld
        (which registers its ClusterName there)."""
        d, data = self.dir, self.dir / "mysql"
        self._run(["mariadb-install-db", "--no-defaults", "--user=root", f"--datadir={data}",
                   "--auth-root-authentication-method=normal", "--skip-test-db"], timeout=120)
        self.procs["mariadbd"] = self._daemon(
            ["mariadbd", "--no-defaults", "--user=root", f"--datadir={data}", f"--socket={d}/mysql.sock",
             f"--port={db_port}", "--bind-address=127.0.0.1", f"--pid-file={d}/mariadbd.pid",
             "--innodb-buffer-pool-size=32M"], "mariadbd")
        self._until(lambda: _port_open(db_port), 60, "MariaDB listening")
        dbd_conf = self.conf.with_name("slurmdbd.conf")
        dbd_conf.write_text(slurmdbd_conf(d, host, dbd_port, db_port))
        os.chmod(dbd_conf, 0o600)
        self.procs["slurmdbd"] = self._daemon(["slurmdbd", "-D"], "slurmdbd")
        self._until(lambda: _port_open(dbd_port), 60, "slurmdbd listening")

    def _until(self, ready, limit_s: float, what: str) -> None:
        deadline = time.time() + limit_s
        while not ready():
            if time.time() > deadline:
                raise RuntimeError(f"{what}: not after {limit_s} s; logs in {self.dir}")
            time.sleep(0.2)

    def stop(self) -> None:
        subprocess.run(["scancel", "--full", "-u", "root"], env=self.env, capture_output=True, timeout=30)
        for name in ("n1", "n2", "slurmctld", "slurmdbd", "mariadbd"):
            proc = self.procs.get(name)
            if proc and proc.poll() is None:
                proc.terminate()
                try:
                    proc.wait(timeout=20)
                except subprocess.TimeoutExpired:
                    proc.kill()
        pid = self.dir / "munge" / "munged.pid"
        if pid.exists():
            try:
                os.kill(int(pid.read_text()), signal.SIGTERM)
            except (ProcessLookupError, ValueError):
                pass

    def _run(self, cmd: list[str], timeout: float = 60) -> str:
        proc = subprocess.run(cmd, env=self.env, capture_output=True, text=True, timeout=timeout)
        if proc.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd)}: exit {proc.returncode}: {proc.stderr.strip()[-2000:]}")
        return proc.stdout

    def _daemon(self, cmd: list[str], log: str) -> subprocess.Popen:
        out = open(self.dir / f"{log}.out", "w")
        return subprocess.Popen(cmd, env=self.env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)

    def _wait_idle(self, limit_s: float) -> None:
        deadline = time.time() + limit_s
        states = {}
        while time.time() < deadline:
            states = {n: self.node(n).get("State", "?") for n in ("n1", "n2")} if self._ctld_up() else {}
            if states and all(s.startswith("IDLE") for s in states.values()):
                return
            time.sleep(0.5)
        raise RuntimeError(f"SLURM nodes not idle after {limit_s} s: {states}; logs in {self.dir}")

    def _ctld_up(self) -> bool:
        return subprocess.run(["scontrol", "ping"], env=self.env, capture_output=True).returncode == 0

    def resume_nodes(self) -> None:
        """Nodes marked DOWN after a node loss come back (a restarted slurmd registers again)."""
        subprocess.run(["scontrol", "update", "nodename=n1,n2", "state=resume"], env=self.env, capture_output=True)
        self._wait_idle(90)

    def kill_node(self, name: str, job_id: int) -> list[int]:
        """Node `name` lost: SIGKILL its slurmd, the job's processes on it (found by their
        SLURM_JOB_ID and SLURMD_NODENAME) and their slurmstepd. Returns the pids killed."""
        self.procs[name].kill()
        pids = [pid for pid, env in _environs().items()
                if env.get("SLURM_JOB_ID") == str(job_id) and env.get("SLURMD_NODENAME") == name]
        parents = {_ppid(pid) for pid in pids}
        stepds = [p for p in parents if p and "slurmstepd" in _cmdline(p)]
        for pid in stepds + pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        return stepds + pids

    def restart_slurmd(self, name: str) -> None:
        """Start node `name`'s slurmd again (after kill_node)."""
        self.procs[name] = self._daemon(["slurmd", "-D", "-f", str(self.conf), "-N", name], f"slurmd-{name}")

    def log_size(self, name: str) -> int:
        log = self.dir / f"slurmd-{name}.log"
        return log.stat().st_size if log.exists() else 0

    def wait_terminate_delivered(self, name: str, job_id: int, offset: int, limit_s: float = 150) -> float:
        """Wait until node `name`'s slurmd has logged (past byte `offset`) both requests to end job
        `job_id`'s lost run that failed while the node was down: the controller's "end job"
        (resent as the node registers) and srun's "kill step J.0" (retried from slurmctld's agent
        queue once per RPC_RETRY_INTERVAL, 60 s). One that reaches the slurmd after the requeued
        job started there kills the new run's step of the same id (SlurmdDebug=debug logs both).
        Returns the seconds waited (``limit_s`` when they did not both come)."""
        start, log = time.time(), self.dir / f"slurmd-{name}.log"
        wanted = [re.compile(rf"_rpc_(terminate|abort)_job: uid = \d+ JobId={job_id}\b"),
                  re.compile(rf"_rpc_signal_tasks: .*(StepId={job_id}\.0|job {job_id})\b")]
        while time.time() - start < limit_s:
            with open(log, "rb") as f:
                f.seek(offset)
                text = f.read().decode(errors="replace")
            if all(w.search(text) for w in wanted):
                break
            time.sleep(0.5)
        return time.time() - start

    # ------------------------------------------------------------------ jobs
    def sbatch(self, args: list[str], env: dict | None = None, cwd=None) -> int:
        out = subprocess.run(["sbatch", "--parsable", *args], env=dict(env or self.env, SLURM_CONF=str(self.conf)),
                             cwd=cwd, capture_output=True, text=True, timeout=60)
        if out.returncode != 0:
            raise RuntimeError(f"sbatch failed: {out.stderr.strip()}")
        return int(out.stdout.strip().split(";")[0])

    def job(self, job_id: int) -> dict:
        """`scontrol show job -o` as a dict (last value wins for repeated keys)."""
        text = self._run(["scontrol", "show", "job", "-o", str(job_id)])
        return dict(x.split("=", 1) for x in text.split() if "=" in x)

    def node(self, name: str) -> dict:
        out = subprocess.run(["scontrol", "show", "node", "-o", name], env=self.env, capture_output=True, text=True)
        return dict(x.split("=", 1) for x in out.stdout.split() if "=" in x)

    def wait(self, job_id: int, done, limit_s: float, what: str = "") -> dict:
        """Poll the job until done(info) is true; AssertionError with the job's state after limit_s."""
        deadline = time.time() + limit_s
        info = {}
        while time.time() < deadline:
            info = self.job(job_id)
            if done(info):
                return info
            time.sleep(0.3)
        raise AssertionError(f"job {job_id}: {what or 'condition'} not met in {limit_s} s: "
                             f"{info.get('JobState')} {info.get('Reason')} restarts={info.get('Restarts')}; "
                             f"its processes: {job_processes(job_id)}; its output: {_tail(info.get('StdOut'))}")

    def release(self, job_id: int) -> None:
        """A requeued job waits for its BeginTime (about 2 min in 22.05): start it now. Not in
        the same second as the requeue: slurmd compares the new credential's creation time with
        the old one's revocation time in whole seconds ("Job credential revoked")."""
        self.wait(job_id, lambda i: i["JobState"] == "PENDING", 120, "pending after requeue")
        time.sleep(2)
        subprocess.run(["scontrol", "update", f"jobid={job_id}", "StartTime=now"], env=self.env, capture_output=True)


def _port_open(port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(0.5)
        return s.connect_ex(("127.0.0.1", port)) == 0


def _environs() -> dict[int, dict]:
    found = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                raw = (entry / "environ").read_bytes()
            except OSError:
                continue
            found[int(entry.name)] = dict(x.split("=", 1) for x in raw.decode(errors="replace").split("\0") if "=" in x)
    return found


def _parent(pid: int) -> int:
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
    except (OSError, ValueError, IndexError):
        return 0


def _top_pythons(job_id: int, keep=lambda env: True) -> list[int]:
    python = {pid for pid, env in _environs().items() if env.get("SLURM_JOB_ID") == str(job_id) and keep(env)
              and "python" in _cmdline(pid).split("\0")[0]}
    return sorted(pid for pid in python if _parent(pid) not in python)


def job_ranks(job_id: int) -> list[int]:
    """The pids of the job's training ranks: the processes whose launcher gave them a RANK, not
    their loader workers (children of a rank, with the rank's environment and command line)."""
    return _top_pythons(job_id, lambda env: "RANK" in env and "TORCHELASTIC_RUN_ID" in env)


def job_runs(job_id: int) -> list[int]:
    """The pid of a one-process job's run (`python -m vlp.executors.job`), not its loader workers."""
    return _top_pythons(job_id)


def job_processes(job_id: int) -> str:
    """For a job that hangs: each of its processes' pid, state, kernel wait channel and command;
    then SIGABRT to its Python processes, whose faulthandler (PYTHONFAULTHANDLER=1, set by the
    tests' submissions) writes every thread's stack to the job's output."""
    rows, python = [], []
    for pid, env in sorted(_environs().items()):
        if env.get("SLURM_JOB_ID") != str(job_id):
            continue
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
            wchan = Path(f"/proc/{pid}/wchan").read_text()
        except OSError:
            continue
        cmd = _cmdline(pid).replace("\0", " ")[:100]
        rows.append(f"{pid} {state} {wchan or '-'} {cmd}")
        if env.get("PYTHONFAULTHANDLER") and "python" in cmd.split(" ")[0]:
            python.append(pid)
    for pid in python:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGABRT)
    time.sleep(2 if python else 0)
    return "; ".join(rows) or "none"


def _tail(path, chars: int = 6000) -> str:
    try:
        return Path(path).read_text(errors="replace")[-chars:]
    except (OSError, TypeError):
        return "-"


def _ppid(pid: int) -> int:
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
    except (OSError, IndexError, ValueError):
        return 0


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace")
    except OSError:
        return ""
