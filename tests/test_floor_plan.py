"""The floor plan's bars, read from the code (docs/design.md): no file in vlp/ over 400 lines, no
function over 60, the persistence package (vlp/checkpoint/) at most 1,200 lines and importing
nothing from the data, train or study packages, the config package importing nothing above the
ground floor, no private name imported across modules, and no import circle among vlp's modules,
counting the imports inside functions (a lazy import that runs back up a floor is still an arrow up)."""
import ast
import re
from pathlib import Path

VLP = Path(__file__).resolve().parent.parent / "vlp"
MAX_FILE_LINES = 400
MAX_FUNCTION_LINES = 60
MAX_CHECKPOINT_CODE_LINES = 1200  # issue 27: from ~2,000


def _modules() -> dict[str, Path]:
    """{dotted module name: file}; a package is named by its folder."""
    out = {}
    for path in sorted(VLP.rglob("*.py")):
        parts = path.relative_to(VLP.parent).with_suffix("").parts
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


def _imported(module: str, node, modules: dict[str, Path]) -> set[str]:
    """The vlp modules an import statement in ``module`` names (the nearest enclosing module)."""
    if isinstance(node, ast.Import):
        names = [a.name for a in node.names]
    else:
        base = node.module or ""
        if node.level:
            package = module.split(".")[:None if modules[module].name == "__init__.py" else -1]
            base = ".".join(package[:len(package) - node.level + 1] + ([base] if base else []))
        names = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names]
    found = set()
    for name in names:
        while name and name not in modules:
            name = name.rpartition(".")[0]
        if name and name != module:
            found.add(name)
    return found


def import_graph() -> dict[str, set[str]]:
    modules = _modules()
    graph = {}
    for name, path in modules.items():
        graph[name] = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.Import, ast.ImportFrom)) and getattr(node, "module", None) != "__future__":
                graph[name] |= _imported(name, node, modules)
    return graph


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan, iterative)."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []
    for start in graph:
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, edges = work[-1]
            for nxt in edges:
                if nxt not in index:
                    index[nxt] = low[nxt] = len(index)
                    stack.append(nxt)
                    on_stack.add(nxt)
                    work.append((nxt, iter(sorted(graph[nxt]))))
                    break
                if nxt in on_stack:
                    low[node] = min(low[node], index[nxt])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    component = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.append(member)
                        if member == node:
                            break
                    if len(component) > 1:
                        found.append(sorted(component))
    return found


def test_no_file_in_vlp_is_over_400_lines():
    long = {str(p.relative_to(VLP.parent)): n for p in VLP.rglob("*.py")
            if (n := len(p.read_text().splitlines())) > MAX_FILE_LINES}
    assert not long, long


def test_the_persistence_package_is_at_most_1200_lines():
    sizes = {p.name: len(p.read_text().splitlines()) for p in (VLP / "checkpoint").glob("*.py")}
    assert {"storage.py", "integrity.py", "files.py", "checkpointer.py", "resume.py", "lock.py"} <= set(sizes)
    assert sum(sizes.values()) <= MAX_CHECKPOINT_CODE_LINES, sizes


def _imports_from(package: str) -> dict[str, set[str]]:
    """{module of `package`: the vlp modules outside it that it imports}."""
    return {name: {m for m in targets if not m.startswith(package)}
            for name, targets in import_graph().items() if name == package or name.startswith(package + ".")}


def test_persistence_imports_nothing_from_data_train_or_study():
    above = {name: {m for m in targets if m.split(".")[1] in ("data", "train", "study")}
             for name, targets in _imports_from("vlp.checkpoint").items()}
    assert not any(above.values()), above


def test_config_imports_only_the_ground_floor():
    outside = _imports_from("vlp.config")
    assert all(targets <= {"vlp.util"} for targets in outside.values()), outside


def test_no_private_name_is_imported_across_modules():
    private = []
    for path in VLP.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("vlp"):
                private += [f"{path.relative_to(VLP.parent)}: {node.module}.{a.name}" for a in node.names
                            if a.name.startswith("_")]
    assert not private, private


def test_the_trainer_does_not_branch_on_sharded():
    assert not re.search(r"\.sharded\b", (VLP / "train" / "loop.py").read_text())


def test_no_function_in_vlp_is_over_60_lines():
    long = {}
    for path in VLP.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                lines = node.end_lineno - node.lineno + 1
                if lines > MAX_FUNCTION_LINES:
                    long[f"{path.relative_to(VLP.parent)}:{node.lineno} {node.name}"] = lines
    assert not long, long


def test_vlp_has_no_import_circles():
    assert circles(import_graph()) == []


def test_the_circle_finder_finds_a_circle():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a", "d"}, "d": set(), "e": {"e"}}
    assert circles(graph) == [["a", "b", "c"]]
    graph = import_graph()
    assert "vlp.util" in graph["vlp.checkpoint.storage"] and "vlp.checkpoint.storage" in graph["vlp.checkpoint.checkpointer"]
    graph["vlp.util"] = graph["vlp.util"] | {"vlp.checkpoint.checkpointer"}  # an arrow back up
    assert any({"vlp.util", "vlp.checkpoint.storage", "vlp.checkpoint.checkpointer"} <= set(c) for c in circles(graph))
