"""Write the list of config keys in docs/configuration.md from their declarations (vlp/config/keys.py).

    python scripts/config_keys.py           # rewrite the list between the page's two markers
    python scripts/config_keys.py --check   # exit 1 when the page is out of step (a test runs this)

Each key's type, default, rule and resume rule come from vlp.config.KEYS and GRID_KEYS (the fields' metadata);
its meaning from the docstring under the field.
"""

from __future__ import annotations

import ast
import dataclasses
import sys
import typing
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # this checkout's vlp, also where an installed one is older

from vlp import config  # noqa: E402  (after the path line above)
from vlp.config import grid_keys, keys as config_keys, rules as config_rules  # noqa: E402

PAGE = REPO / "docs" / "configuration.md"
BEGIN = "<!-- config keys: written by scripts/config_keys.py from vlp/config/keys.py; do not edit -->"
END = "<!-- end of config keys -->"


def docstrings() -> dict[str, str]:
    """'Section.field' and 'Section' -> its docstring (one line), read from vlp/config/keys.py and
    grid_keys.py."""
    out = {}
    trees = [ast.parse(Path(module.__file__).read_text()) for module in (config_keys, grid_keys)]
    for cls in (n for tree in trees for n in tree.body if isinstance(n, ast.ClassDef)):
        out[cls.name] = " ".join((ast.get_docstring(cls) or "").split())
        for node, after in zip(cls.body, cls.body[1:]):
            if (isinstance(node, ast.AnnAssign) and isinstance(after, ast.Expr)
                    and isinstance(after.value, ast.Constant) and isinstance(after.value.value, str)):
                out[f"{cls.name}.{node.target.id}"] = " ".join(after.value.value.split())
    return out


def type_text(tp) -> str:
    """The values a type allows, in words: 'int', 'one of a, b', '... or null'."""
    args = typing.get_args(tp)
    if typing.get_origin(tp) is typing.Union:
        return " or ".join(type_text(a) for a in args if a is not type(None)) + " or null"
    if typing.get_origin(tp) is typing.Literal:
        return "one of " + ", ".join(f"`{a}`" for a in args)
    if typing.get_origin(tp) in (list, dict):
        return f"list of {args[0].__name__}" if typing.get_origin(tp) is list else "mapping"
    if dataclasses.is_dataclass(tp):  # a grid: key of its own keys (listed below it)
        return "mapping"
    return "list or mapping" if tp is typing.Any else tp.__name__  # Any: grid.datasets


def value_text(value) -> str:
    if value in ([], {}):
        return "`[]`" if value == [] else "`{}`"
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    return f"`{value}`" if value != "" else '`""`'


def resume_text(rule: config_rules.KeyRule) -> str:
    if rule.kind == config_rules.PLAN.kind:
        return "plans the runs (a grid: key)"
    if rule.kind == config_rules.REFUSE:
        return f"refused ({rule.why})"
    if rule.kind == config_rules.LAYOUT:
        return "layout: refused when exact, applied when continue"
    if rule.quiet:
        return "applied, not logged"
    return "applied" if rule.results else "applied (changes no result)"


def cell(text: str) -> str:
    """`text` for a table cell: '|' escaped, and '<' outside code spans (`pypi:<package>` would read as a tag)."""
    parts = text.replace("|", "\\|").split("`")
    return "`".join(part if i % 2 else part.replace("<", "&lt;") for i, part in enumerate(parts))


def owner_field(cls, parts: list[str]) -> str:
    """'Class.field' of the field that declares a key, given its dotted parts after the section (a
    nested group's key, grid.slurm.poll_s: 'SlurmConfig.poll_s', grid.seeds_until.step: 'SeedsUntil.step'; a
    key a section inherits, grid.slurm.time: 'SlurmResources.time')."""
    for part in parts[:-1]:
        hint = typing.get_type_hints(cls)[part]
        cls = config.group_of(hint) or hint  # a group (Optional[SeedsUntil]) or a section (SlurmConfig)
    owner = next(c for c in cls.__mro__ if parts[-1] in vars(c).get("__annotations__", {}))  # SlurmResources.time
    return f"{owner.__name__}.{parts[-1]}"


def keys_markdown() -> str:
    """The generated part of the page: one table per section, `grid:` (vlp compare) last."""
    docs = docstrings()
    sections = {**typing.get_type_hints(config.Config), "grid": grid_keys.GridConfig}
    lines = []
    for section, cls in sections.items():
        lines += [f"### `{section}`", "", docs.get(cls.__name__, ""), "",
                  "| key | type | default | accepts | on resume | meaning |", "|---|---|---|---|---|---|"]
        for name, k in {**config.KEYS, **config.GRID_KEYS}.items():
            if name.split(".")[0] != section:
                continue
            accepts = "" if k.rule is config_rules.ANY else k.rule.allowed
            meaning = docs.get(owner_field(cls, name.split(".")[1:]), "")
            cells = [f"`{name}`", type_text(k.type), value_text(k.default), accepts, resume_text(k.resume), meaning]
            lines.append("| " + " | ".join(map(cell, cells)) + " |")
        lines.append("")
    return "\n".join(lines)


def with_keys(page: str) -> str:
    """`page` with the text between its markers replaced by keys_markdown()."""
    head, sep, rest = page.partition(BEGIN)
    _, sep2, tail = rest.partition(END)
    if not (sep and sep2):
        raise SystemExit(f"{PAGE}: the markers {BEGIN!r} and {END!r} are missing")
    return f"{head}{BEGIN}\n\n{keys_markdown()}\n{END}{tail}"


def main(argv: list[str]) -> int:
    page = PAGE.read_text()
    fresh = with_keys(page)
    if "--check" in argv:
        if fresh != page:
            print(f"{PAGE} is out of step with vlp/config/keys.py: run python scripts/config_keys.py", file=sys.stderr)
            return 1
        return 0
    PAGE.write_text(fresh)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
