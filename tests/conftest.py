"""Project-wide fixtures (tiny real shards shared by trainer/CLI tests) and the test tiers
(tests/tiers.py decides them, the hooks here apply them and report slow unlisted tests)."""
import os

import pytest

from tiers import SLOW_LIST, SLOW_S, base_id, markers, read_list

os.environ.setdefault("OMP_NUM_THREADS", "1")


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


_SLOW: set[str] = set()  # node ids this session marked slow
_TOOK: dict[str, float] = {}  # node id -> seconds (setup + call + teardown)


def pytest_collection_modifyitems(config, items):
    listed = read_list(SLOW_LIST)
    for item in items:
        found = markers(item, listed)
        for name in sorted(found):
            item.add_marker(name)
        if "slow" in found:
            _SLOW.add(item.nodeid)



def pytest_runtest_logreport(report):
    """Sums each test's phases. VLP_TEST_DURATIONS=FILE also appends 'seconds<TAB>phase<TAB>node id'
    as each phase ends, so a run cut short still leaves its figures."""
    _TOOK[report.nodeid] = _TOOK.get(report.nodeid, 0.0) + report.duration
    path = os.environ.get("VLP_TEST_DURATIONS")
    if path:
        with open(path, "a") as f:
            f.write(f"{report.duration:.3f}\t{report.when}\t{report.nodeid}\n")


def pytest_terminal_summary(terminalreporter):
    """Names the tests (all cases of a function together) that took over SLOW_S seconds but are
    not in the slow tier."""
    fast: dict[str, float] = {}
    for nodeid, seconds in _TOOK.items():
        if nodeid not in _SLOW:
            fast[base_id(nodeid)] = fast.get(base_id(nodeid), 0.0) + seconds
    late = sorted(n for n, s in fast.items() if s > SLOW_S)
    if late:
        terminalreporter.write_line(
            f"vlp: {len(late)} test(s) took over {SLOW_S:.0f} s and are not in tests/slow_tests.txt "
            f"(add them if a quiet machine agrees): " + ", ".join(late[:10]))
