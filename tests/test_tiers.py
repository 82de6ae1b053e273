"""The tiers stay honest: tests/slow_tests.txt names real tests, the tier rule holds for every
collected item of this session (multiproc is slow), the markers are declared in the test files
(no tier is inferred from the code), and xdist groups are files."""
import ast
import re

import pytest

from tiers import SLOW_LIST, TESTS, TIERS, groups, plain_id, read_list


def _defined(path) -> set[str]:
    """'name' and 'Class::name' for every test function of a file."""
    tree = ast.parse(path.read_text())
    out = set()
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            out.add(node.name)
        elif isinstance(node, ast.ClassDef):
            out |= {f"{node.name}::{f.name}" for f in node.body if isinstance(f, ast.FunctionDef)}
    return out


def test_every_slow_entry_names_a_test_once():
    lines = [line.split("#", 1)[0].strip() for line in SLOW_LIST.read_text().splitlines()]
    entries = [line for line in lines if line]
    assert len(entries) == len(set(entries)) == len(read_list(SLOW_LIST))
    missing = []
    for entry in entries:
        path, _, name = entry.partition("::")
        file = TESTS.parent / path
        if "[" in entry or not file.is_file() or name not in _defined(file):
            missing.append(entry)
    assert not missing, f"tests/slow_tests.txt names tests that do not exist (or with [params]): {missing}"


def test_the_tier_rule_holds_for_every_item_of_this_session(request):
    for item in request.session.items:
        names = {m.name for m in item.iter_markers()} & set(TIERS)
        assert "multiproc" not in names or "slow" in names, item.nodeid
    here = {m.name for m in request.node.iter_markers()} & set(TIERS)
    assert here == set()  # this file starts nothing: it is in the fast tier


def test_the_fast_tier_is_selected_by_markers_the_files_declare(request):
    """Which tests start processes or servers is written in the test files (pytestmark or a
    decorator), where a reader sees it; the suite's process-starting files declare it."""
    marked = {item.nodeid.split("::", 1)[0] for item in request.session.items
              if item.get_closest_marker("multiproc") is not None}
    for path in ("tests/cli/test_slurm.py", "tests/train/test_two_process.py", "tests/test_packaging.py"):
        assert path in marked or not any(i.nodeid.startswith(path) for i in request.session.items), path


def test_groups_are_the_files_of_module_fixtures_only(request):
    """Each xdist group is one file (its tests share a fixture built once); no group of launches:
    two workers' `accelerate launch` runs can run side by side (the next test's ports)."""
    got = groups(request.session.items)
    assert all(group == nodeid.split("::", 1)[0] for nodeid, group in got.items()), got


def test_grouped_tests_carry_their_group_where_the_scheduler_reads_it(request):
    """Under `--dist loadgroup` (the README's command) each grouped test's node id ends in
    '@<group>', which is all pytest-xdist's scheduler reads; without xdist no id changes."""
    loadgroup = getattr(request.config.option, "loadgroup", False)
    items = request.session.items
    plain = {plain_id(item.nodeid): item.nodeid for item in items}
    got = {plain_id(nodeid): group for nodeid, group in groups(items).items()}
    suffixed = {nodeid for nodeid in plain.values() if nodeid != plain_id(nodeid)}
    if loadgroup:
        assert all(plain[nodeid] == f"{nodeid}@{group}" for nodeid, group in got.items())
    assert len(suffixed) == (len(got) if loadgroup else 0)


def test_no_test_derives_a_port_from_its_pid():
    """Every port a test hands a launcher or server comes from vlp_testing.free_port:
    a port derived from the pytest pid can meet another worker's (or another session's)."""
    found = [f"{path.relative_to(TESTS)}:{n}" for path in sorted(TESTS.rglob("*.py"))
             for n, line in enumerate(path.read_text().splitlines(), 1)
             if re.search(r"getpid\(\)\s*[%+]", line)]  # "29500 + pid % 1000" and its variants
    assert found == []
