"""The test tiers, read from the code (tests/conftest.py applies them at collection; docs/testing.md).

A test *reaches* what its function, the fixtures it uses and the test-side helpers they call
refer to, followed through tests/ (not into vlp/):
- ``multiproc``: it reaches subprocess, multiprocessing, torch.multiprocessing or a process pool;
- ``server``: it reaches http.server / socketserver or tests/object_store.py's servers and proxy;
- ``slow``: it is ``multiproc`` (starting Python with torch costs seconds), or it is listed in
  tests/slow_tests.txt (measured: over SLOW_S seconds on 2 loaded cores).
The inner loop is ``pytest -m "not slow"``; a new test gets its markers without anyone remembering,
and a new in-process test that is slow is named at the end of every run until it is listed.
"""
import dis
import functools
import importlib
import importlib.util
import inspect
import sys
import types
from pathlib import Path

TESTS = Path(__file__).resolve().parent
SLOW_LIST = TESTS / "slow_tests.txt"
SLOW_S = 3.0  # a test function over this (all its cases, setup + call + teardown) belongs in SLOW_LIST
TIERS = ("slow", "multiproc", "server")
PROCESS_MODULES = ("subprocess", "multiprocessing", "torch.multiprocessing", "concurrent.futures.process")
SERVER_MODULES = ("http.server", "socketserver")
SERVER_HELPERS = {("object_store", "start_s3"), ("object_store", "start_gcs"), ("object_store", "DropProxy")}


def _ours(obj) -> bool:
    """Defined in a file under tests/ (so its code is read too)."""
    code = getattr(obj, "__code__", None)
    if code is not None:
        return Path(code.co_filename).resolve().is_relative_to(TESTS)
    module = sys.modules.get(getattr(obj, "__module__", "") or "")
    file = getattr(module, "__file__", None)
    return inspect.isclass(obj) and file is not None and Path(file).resolve().is_relative_to(TESTS)


def _codes(code: types.CodeType):
    yield code
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            yield from _codes(const)


def _members(cls) -> list:
    out = []
    for value in vars(cls).values():
        value = getattr(value, "__func__", value)  # staticmethod / classmethod
        out += [f for f in (getattr(value, "fget", None), value) if inspect.isfunction(f)]
    return out


@functools.cache
def _neighbours(fn) -> tuple[frozenset, tuple]:
    """(module-qualified names fn refers to, the test-side functions and classes among them)."""
    if inspect.isclass(fn):
        return frozenset(), tuple(_members(fn))
    names, inner = set(), []
    scope = fn.__globals__
    cells = [c.cell_contents for c in (fn.__closure__ or ()) if _filled(c)]
    for code in _codes(fn.__code__):
        wanted = set(code.co_names)
        objs = [scope.get(n) for n in wanted] + cells
        objs += [v for o in objs if isinstance(o, (dict, list, tuple, set))  # STARTERS = {"s3": start_s3}
                 for v in (o.values() if isinstance(o, dict) else o)]
        objs += _imported(code, names)  # `import m` / `from m import x` inside the function
        objs += [vars(m).get(n) for m in objs if isinstance(m, types.ModuleType) for n in wanted]
        for obj in objs:
            if isinstance(obj, types.ModuleType):
                names.add(obj.__name__)
            elif inspect.isfunction(obj) or inspect.isclass(obj):
                names.add(f"{obj.__module__}.{obj.__qualname__}")
                if _ours(obj):
                    inner.append(obj)
    return frozenset(names), tuple(inner)


def _module(name: str):
    """An imported module by name; a test-side one is imported here; None for any other not yet
    imported (its name is still recorded)."""
    if name in sys.modules:
        return sys.modules[name]
    try:
        spec = importlib.util.find_spec(name)
    except (ImportError, ValueError):
        return None
    origin = getattr(spec, "origin", None)
    if origin and Path(origin).resolve().is_relative_to(TESTS):
        return importlib.import_module(name)
    return None


def _imported(code: types.CodeType, names: set) -> list:
    """The modules and objects a function imports in its own body (names records them even when
    they cannot be resolved here)."""
    out, module, source = [], None, ""
    for ins in dis.get_instructions(code):
        if ins.opname == "IMPORT_NAME":
            source = ins.argval
            names.add(source)
            module = _module(source)
            out.append(module)
        elif ins.opname == "IMPORT_FROM":
            names.add(f"{source}.{ins.argval}")
            out.append(getattr(module, ins.argval, None) if module is not None else None)
    return out


def _filled(cell) -> bool:
    try:
        cell.cell_contents
    except ValueError:
        return False
    return True


def reached(start: list) -> set[str]:
    """Every module-qualified name the functions in start refer to, following test-side code."""
    out, todo, seen = set(), list(start), set()
    while todo:
        fn = todo.pop()
        if fn is None or id(fn) in seen or not _ours(fn):
            continue
        seen.add(id(fn))
        names, inner = _neighbours(fn)
        out |= names
        todo += inner
    return out


def _under(name: str, modules) -> bool:
    return any(name == m or name.startswith(m + ".") for m in modules)


def kinds(names: set[str]) -> set[str]:
    """The markers a set of reached names implies."""
    found = set()
    if any(_under(n, PROCESS_MODULES) for n in names):
        found.add("multiproc")
    if any(_under(n, SERVER_MODULES) for n in names) or {tuple(n.split(".", 1)) for n in names} & SERVER_HELPERS:
        found.add("server")
    return found


def fixture_functions(item) -> list:
    defs = getattr(item, "_fixtureinfo", None)
    if defs is None:
        return []
    return [d[-1].func for name in item.fixturenames if (d := defs.name2fixturedefs.get(name))]


def _builds_once(item) -> bool:
    """It uses a module-, class- or session-scoped fixture of its own file (not a conftest's)."""
    defs = getattr(item, "_fixtureinfo", None)
    for name in item.fixturenames if defs is not None else ():
        fixture = (defs.name2fixturedefs.get(name) or [None])[-1]
        if fixture is not None and fixture.scope != "function" and _ours(fixture.func) \
                and Path(fixture.func.__code__.co_filename).name != "conftest.py":
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
    """The tier markers of one collected test item."""
    found = kinds(reached([getattr(item, "obj", None), *fixture_functions(item)]))
    if "multiproc" in found or base_id(item.nodeid) in slow_list:
        found.add("slow")
    return found
