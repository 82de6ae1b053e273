"""The test tiers (tests/conftest.py applies them at collection; docs/testing.md), declared, never
inferred from the code:
- ``multiproc``: the test starts other processes or ranks (subprocess, multiprocessing, accelerate
  launch, gloo); ``server``: it talks to a loopback server (HTTP, S3 by moto, GCS by
  fake-gcs-server). Each is a marker the test file declares: ``pytestmark`` for a whole file, or
  ``@pytest.mark.multiproc`` on a test.
- ``slow``: every ``multiproc`` test (starting Python with torch costs seconds), and the in-process
  tests listed in tests/slow_tests.txt (measured: over SLOW_S seconds on 2 loaded cores).
The inner loop is ``pytest -m "not slow"``; a new in-process test that is slow is named at the end
of every run until it is listed.
"""
from pathlib import Path

TESTS = Path(__file__).resolve().parent.parent
SLOW_LIST = TESTS / "slow_tests.txt"
SLOW_S = 3.0  # a test function over this (all its cases, setup + call + teardown) belongs in SLOW_LIST
TIERS = ("slow", "multiproc", "server")


def _builds_once(item) -> bool:
    """It uses a module-, class- or session-scoped fixture of its own file (not a conftest's)."""
    defs = getattr(item, "_fixtureinfo", None)
    for name in item.fixturenames if defs is not None else ():
        fixture = (defs.name2fixturedefs.get(name) or [None])[-1]
        code = getattr(getattr(fixture, "func", None), "__code__", None)
        if fixture is not None and fixture.scope != "function" and code is not None \
                and Path(code.co_filename).resolve().is_relative_to(TESTS) and Path(code.co_filename).name != "conftest.py":
            return True
    return False


def groups(items) -> dict[str, str]:
    """{node id: xdist group} for the tests that must share one pytest-xdist worker: those using a
    module-, class- or session-scoped fixture of their own file go into a group named after the
    file (the fixture is built once, by one worker: the SLURM cluster, 2-rank results). Tests not
    named run wherever a worker is free; `accelerate launch` runs among them take their ports from
    vlp_testing.free_port (a random free port below the ephemeral range), so two workers' launches do not meet on one port."""
    return {item.nodeid: item.nodeid.split("::", 1)[0] for item in items if _builds_once(item)}


def join_group(item, group: str) -> None:
    """Puts a test in a pytest-xdist group: loadgroup schedules by the node id's '@group' suffix.
    pytest-xdist 3.8 adds it for an xdist_group marker by setting item._nodeid, which pytest 9.2
    no longer reads (its node ids are structured, in item._id): with the marker alone each group's
    tests went to both workers, and both built its fixture (two SLURM clusters, two FSDP runs)."""
    suffixed = f"{item.nodeid}@{group}"
    if hasattr(item, "_id"):
        item._id = type(item._id).parse(suffixed)
    else:
        item._nodeid = suffixed


def plain_id(nodeid: str) -> str:
    """The node id without the '@group' suffix pytest-xdist's loadgroup gives grouped tests."""
    head, at, tail = nodeid.rpartition("@")
    return head if at and "]" not in tail and "::" not in tail else nodeid


def base_id(nodeid: str) -> str:
    """The node id without its parametrization: one line of SLOW_LIST covers every case."""
    return nodeid.split("[", 1)[0]


def read_list(path: Path) -> set[str]:
    if not path.is_file():
        return set()
    lines = (line.split("#", 1)[0].strip() for line in path.read_text().splitlines())
    return {line for line in lines if line}


def markers(item, slow_list: set[str]) -> set[str]:
    """The tier markers of one collected test item: its declared ones, and slow where it is
    multiproc or listed."""
    found = {m.name for m in item.iter_markers()} & set(TIERS)
    if "multiproc" in found or base_id(item.nodeid) in slow_list:
        found.add("slow")
    return found
