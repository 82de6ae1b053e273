"""Project-wide fixtures (tiny real shards shared by trainer/CLI tests), the test tiers (declared
markers and tests/slow_tests.txt, read by tests/support/tiers.py; the hooks here apply them and
report slow unlisted tests) and the pytest-xdist groups (tests that must share one worker:
tests/support/tiers.py ``groups``). The tests' helpers live in tests/support/."""
import os
import resource
import signal
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent / "support"))  # the tests' helpers: tests/support/

import pytest
from xdist.scheduler import LoadGroupScheduling

from tiers import SLOW_LIST, SLOW_S, base_id, groups, join_group, markers, plain_id, read_list

os.environ.setdefault("OMP_NUM_THREADS", "1")


@pytest.fixture(autouse=True)
def _temp_files_inside_pytests_tree(tmp_path_factory, monkeypatch):
    """Each test's temporary files, and its processes', go to a folder of pytest's own tree (which
    pytest removes: tmp_path_retention_policy), not the machine's temp dir: what a process killed
    on purpose cannot remove (multiprocessing's pymp-*, torch's elastic agent's torchelastic_* logs)
    goes with it. tests/test_leftovers.py checks that the suite leaves nothing there."""
    monkeypatch.setenv("TMPDIR", str(tmp_path_factory.mktemp("tmp")))
    monkeypatch.setattr(tempfile, "tempdir", None)  # gettempdir() reads TMPDIR again


@pytest.fixture(scope="session")
def tiny_shards(tmp_path_factory):
    """{'train': spec (160 pairs in 3 uneven shards), 'eval': spec (40 pairs)} at 32 px."""
    from vlp.data.sources.openmoji import load_pairs
    from vlp.data.write import write_shards

    root = tmp_path_factory.mktemp("tiny_shards")
    train = load_pairs("train", image_size=32)[:160]
    held = load_pairs("eval", image_size=32)[:40]
    return {
        "train": write_shards(train, root / "train", prefix="train", samples_per_shard=64).spec,
        "eval": write_shards(held, root / "eval", prefix="eval", samples_per_shard=64).spec,
    }


_TOOK: dict[str, float] = {}  # node id -> seconds (setup + call + teardown), tests not in the slow tier
_CONFIG: list = []  # this session's config (pytest_configure)
_CPU = [0.0]  # this process's CPU seconds (its own and its waited-for children's) at the last mark


@pytest.hookimpl(tryfirst=True)  # before pytest's -m deselection and xdist's group suffixes
def pytest_collection_modifyitems(config, items):
    listed = read_list(SLOW_LIST)
    grouped = groups(items)
    for item in items:
        for name in sorted(markers(item, listed)):
            item.add_marker(name)
        if item.nodeid in grouped and getattr(config.option, "loadgroup", False):  # an xdist worker's items
            join_group(item, grouped[item.nodeid])
    if _worker(config):  # the slow tier first, so that the run ends on short tests on both workers
        items.sort(key=lambda item: item.get_closest_marker("slow") is None)


def _cpu_now() -> float:
    own, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + kids.ru_utime + kids.ru_stime


def pytest_runtest_logstart(nodeid, location):
    _CPU[0] = _cpu_now()


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item, call):
    """Each phase's report carries the CPU seconds it took (in the process that ran it, so also
    from an xdist worker): ('cpu_s', seconds) in report.user_properties."""
    report = yield
    now = _cpu_now()
    report.user_properties.append(("cpu_s", round(now - _CPU[0], 3)))
    _CPU[0] = now
    return report


class _GroupScheduling(LoadGroupScheduling):
    """pytest-xdist's loadgroup, except that a test whose worker crashed is reported as failed
    once and not run again: loadgroup puts the crashed test back in the queue with the rest of
    its group, so the next worker runs it and crashes too, and the run hangs (pytest-xdist 3.8)."""

    def remove_node(self, node):
        workload = self.assigned_work.pop(node)
        pending = [nodeid for unit in workload.values() for nodeid, done in unit.items() if not done]
        if not pending:
            return None
        crashed = pending[0]  # tests run in the order they were sent: the first not done was running
        for unit in workload.values():
            unit.pop(crashed, None)
        self.workqueue.update((scope, unit) for scope, unit in workload.items() if not all(unit.values()))
        for other in self.assigned_work:
            self._reschedule(other)
        return crashed


def pytest_xdist_make_scheduler(config, log):
    if config.getvalue("dist") == "loadgroup":
        return _GroupScheduling(config, log)
    return None


def _worker(config) -> bool:
    return hasattr(config, "workerinput")  # an xdist worker: its controller reports and writes


def _hung_up(signum, frame) -> None:
    """SIGHUP in a pytest started under nohup: nothing (pytest_configure)."""


@pytest.hookimpl(trylast=True)  # after pytest's tmp_path_factory exists
def pytest_configure(config):
    """The session's temporary files, from collection on, under pytest's tree as each test's are
    (below): its module fixtures' (a module's 2-rank launch: torch's elastic agent's torchelastic_*
    logs), and torch.compile's on-disk cache, one per session, for every test's processes. Before
    collection: importing torch._dynamo makes that cache's folder in the temp dir."""
    _CONFIG[:] = [config]
    if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
        # started as `pytest &` from a script (a shell ignores SIGINT in its background jobs, and
        # Python then installs no handler): every process a test starts would inherit it, and the
        # tests of Ctrl-C would send it to processes that cannot take it (launch/local.sh cannot
        # even trap a signal ignored on entry)
        signal.signal(signal.SIGINT, signal.default_int_handler)
    if signal.getsignal(signal.SIGHUP) is signal.SIG_IGN:
        # started under nohup: every process a test starts would inherit the ignore, and a `vlp`
        # started with SIGHUP ignored keeps ignoring it (vlp.train.preempt.nohup), so the tests of
        # SIGHUP would see no stop. A handler that does nothing keeps this pytest alive through a
        # hang-up, as nohup asked, and is not inherited across exec: the processes get the default.
        signal.signal(signal.SIGHUP, _hung_up)
    factory = config._tmp_path_factory
    os.environ["TMPDIR"] = str(factory.mktemp("session-tmp"))
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(factory.mktemp("inductor"))
    tempfile.tempdir = None


def pytest_runtest_logreport(report):
    """Sums each test's phases. VLP_TEST_DURATIONS=FILE also appends
    'seconds<TAB>phase<TAB>node id<TAB>CPU seconds' as each phase ends (in the controller only
    under xdist, node ids without the xdist group suffix), so a run cut short still leaves its figures."""
    if _CONFIG and _worker(_CONFIG[0]):
        return
    nodeid = plain_id(report.nodeid)
    if "slow" not in report.keywords:
        _TOOK[nodeid] = _TOOK.get(nodeid, 0.0) + report.duration
    path = os.environ.get("VLP_TEST_DURATIONS")
    if path:
        cpu = dict(report.user_properties).get("cpu_s", float("nan"))
        with open(path, "a") as f:
            f.write(f"{report.duration:.3f}\t{report.when}\t{nodeid}\t{cpu:.3f}\n")


def pytest_terminal_summary(terminalreporter):
    """Names the tests (all cases of a function together) that took over SLOW_S seconds but are
    not in the slow tier."""
    fast: dict[str, float] = {}
    for nodeid, seconds in _TOOK.items():
        fast[base_id(nodeid)] = fast.get(base_id(nodeid), 0.0) + seconds
    late = sorted(n for n, s in fast.items() if s > SLOW_S)
    if late:
        terminalreporter.write_line(
            f"vlp: {len(late)} test(s) took over {SLOW_S:.0f} s and are not in tests/slow_tests.txt "
            f"(add them if a quiet machine agrees): " + ", ".join(late[:10]))
