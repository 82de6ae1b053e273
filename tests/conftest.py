"""Project-wide fixtures: tiny real shards (OpenMoji subset) shared by trainer/CLI tests."""
import os

import pytest

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


def pytest_runtest_logreport(report):
    """VLP_TEST_DURATIONS=FILE appends 'seconds<TAB>node id' per test (setup+call+teardown summed
    by the reader), as each phase ends, so a run cut short still leaves its figures."""
    path = os.environ.get("VLP_TEST_DURATIONS")
    if path:
        with open(path, "a") as f:
            f.write(f"{report.duration:.3f}\t{report.when}\t{report.nodeid}\n")
