"""Typed experiment config: its sections, YAML files and dotted command-line overrides.

    cfg = load_config("configs/demo.yaml", ["loss.name=flatnce", "data.batch_per_device=32"])  # vlp.experiment

Each key is declared once, as a field of its section in vlp/config/keys.py: type, default,
validation rule, resume rule and a docstring. `KEYS` and `RULES` here (and vlp.checkpoint.resume's
`RESUME_RULES`) are read from those fields. Unknown keys, wrong types, impossible values and
malformed or repeated overrides raise `ConfigError` with one line that names the offending key
(docs/configuration.md).
"""

from __future__ import annotations

import dataclasses
import sys
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator, Optional, Sequence

import yaml

from vlp import util
from vlp.config.grid_keys import GridConfig
from vlp.config.keys import DataConfig, EvalConfig, LossConfig, ModelConfig, OptimConfig, TrainConfig
from vlp.config.rules import ConfigError, KeyRule, Rule, check_type, short

# the configs shipped in the package (symlinks to configs/*.yaml in the clone): vlp demo, vlp compare
PACKAGED_DEFAULTS = Path(__file__).resolve().parent.parent / "defaults"


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    loss: LossConfig = field(default_factory=LossConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)

    def check_keys(self) -> "Config":
        """Check every key against its rule (RULES), then the rules that join keys. What needs the
        registry of losses and models (a loss name, its temperature policy, a packaged tower) is
        checked by the layer that builds them: vlp.experiment.check, which calls this first."""
        for key, value in self.entries():
            key.rule.check(key.name, value)
        for why in (parallel_problem(self), feature_cache_problem(self), cuda_graphs_problem(self)):
            if why:
                raise ConfigError(f"config: {why}")
        return self

    def entries(self) -> Iterator[tuple["ConfigKey", Any]]:
        """Every key (its declaration, KEYS) with its value here, in section order."""
        for key in KEYS.values():
            yield key, get_dotted(self, key.name)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def global_batch(cfg: "Config | dict", world: int = 1, accum: Optional[int] = None) -> int:
    """Samples per optimizer step: data.batch_per_device x processes x train.accum_steps (accum=1:
    one batch of every process). `cfg` may be a saved config's dict (an old one lacking a key:
    0 per device, 1 accum step)."""
    accum = get_dotted(cfg, "train.accum_steps", 1) if accum is None else accum
    return get_dotted(cfg, "data.batch_per_device", 0) * world * accum


def steps_for(samples: int, batch: int) -> int:
    """Optimizer steps a sample budget makes at global batch `batch`: samples // batch (the rest,
    under one batch, is not trained). The one rule: the Trainer, the study's plans and its budgets."""
    return samples // batch


def parallel_problem(cfg: "Config") -> Optional[str]:
    """Why train.parallel cannot be used with this config (one line), else None."""
    t = cfg.train
    if t.parallel == "fsdp" and (t.precision == "fp16" or t.compile):
        what = "precision=fp16 (use bf16)" if t.precision == "fp16" else "compile=true"
        return f"train.parallel=fsdp does not support train.{what}"
    return None


def cuda_graphs_problem(cfg: "Config") -> Optional[str]:
    """Why train.cuda_graphs cannot be used with this config (one line), else None; the device
    (CUDA only) is checked by the trainer (vlp.train.static_step.static_step)."""
    t = cfg.train
    if not t.cuda_graphs:
        return None
    for bad, why in ((t.parallel == "fsdp", "train.parallel=fsdp (FSDP2's hooks are not captured; use ddp)"),
                     (t.precision == "fp16", "train.precision=fp16 (its scaler reads the host; use bf16)"),
                     (cfg.optim.name != "adamw", f"optim.name={cfg.optim.name} (a device-side skip needs fused adamw)"),
                     (cfg.loss.gamma_schedule != "constant", "loss.gamma_schedule=cosine (gamma is fixed in the graph)")):
        if bad:
            return f"train.cuda_graphs=true does not run with {why}"
    return None


def feature_cache_problem(cfg: "Config") -> Optional[str]:
    """Why data.feature_cache cannot be used with this config (one line), else None: cached
    features must be a pure function of the sample, so the transform is deterministic and no
    part of the cached towers trains."""
    d, m = cfg.data, cfg.model
    if not d.feature_cache:
        return None
    if d.train_transform == "augment":
        return ("data.feature_cache needs data.train_transform=eval: the augment transform is random "
                "(a new crop every epoch), cached features would not be")
    training = [name for name, value in (("model.lock_image=false", not m.lock_image),
                                         ("model.lock_text=false", not m.lock_text),
                                         (f"model.lock_image_unlocked_groups={m.lock_image_unlocked_groups}",
                                          m.lock_image_unlocked_groups > 0),
                                         (f"model.lock_text_unlocked_layers={m.lock_text_unlocked_layers}",
                                          m.lock_text_unlocked_layers > 0)) if value]
    if training:
        return (f"data.feature_cache caches the locked towers, but a tower trains ({', '.join(training)}): "
                "lock both towers whole")
    if cfg.train.parallel == "fsdp":
        return "data.feature_cache supports train.parallel=ddp only"
    return None


# ----------------------------------------------------------------------------- the keys
@dataclass(frozen=True)
class ConfigKey:
    """One config key as its field declares it (vlp/config/keys.py)."""

    name: str  # dotted: "data.batch_per_device"
    type: Any  # the field's annotation, resolved
    default: Any
    rule: Rule  # what it accepts (vlp.config.rules)
    resume: KeyRule  # what a resume does with a changed value (vlp.checkpoint.resume)


def group_of(tp: Any) -> Optional[type]:
    """The dataclass of a key whose value is a mapping of its own keys (Optional[SeedsUntil]), else None."""
    if typing.get_origin(tp) is dict:  # names -> groups (entries_of)
        return None
    return next((t for t in typing.get_args(tp) if dataclasses.is_dataclass(t)), None)


def entries_of(tp: Any) -> Optional[type]:
    """The dataclass of a key that maps names to groups of some of its section's own keys
    (grid.slurm.regimes: dict[str, SlurmResources]), else None."""
    args = typing.get_args(tp)
    return args[1] if typing.get_origin(tp) is dict and len(args) == 2 and dataclasses.is_dataclass(args[1]) else None


def declared_keys(cls: type, prefix: str = "") -> Iterator[ConfigKey]:
    """The keys of config dataclass `cls` (its sections' too), read from their fields; a field
    declared without `key(default, rule, resume)` is a TypeError (it would have no rule)."""
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        name, tp = f"{prefix}{f.name}", hints[f.name]
        if dataclasses.is_dataclass(tp):
            yield from declared_keys(tp, f"{name}.")
        elif "rule" in f.metadata and "resume" in f.metadata:
            default = f.default_factory() if f.default is dataclasses.MISSING else f.default
            yield ConfigKey(name, tp, default, f.metadata["rule"], f.metadata["resume"])
            if group_of(tp):  # a grid: key's own keys (grid.seeds_until.step)
                yield from declared_keys(group_of(tp), f"{name}.")
        else:
            raise TypeError(f"config key {name} is declared without vlp.config.rules.key(default, rule, resume)")


KEYS: dict[str, ConfigKey] = {k.name: k for k in declared_keys(Config)}
"""Every config key in section order, e.g. KEYS["data.batch_per_device"].rule."""
HARMLESS_KEYS = tuple(name for name, k in KEYS.items() if not k.resume.results)
"""Keys that may change between a finished run and a rerun without making it stale (stale_key)."""

RULES: dict[str, Rule] = {name: k.rule for name, k in KEYS.items()}
"""What each key accepts: the validation table, read from the fields."""

GRID_KEYS: dict[str, ConfigKey] = {k.name: k for k in declared_keys(GridConfig, "grid.")}
"""The `grid:` keys of `vlp compare` (vlp/config/grid_keys.py GridConfig), e.g. GRID_KEYS["grid.seeds"]."""


def read_grid(raw: Any) -> GridConfig:
    """The `grid:` mapping -> GridConfig: unknown keys, wrong types and values against their rules
    refused in one line each; null is the key's default; losses, batch_per_device and seeds required,
    and a group's keys declared without a default (grid.seeds_until.step)."""
    if not isinstance(raw, dict):
        raise ConfigError("config: compare needs a 'grid:' section with losses, batch_per_device and seeds")
    given = {k: v for k, v in raw.items() if v is not None}
    grid = from_dict(given, GridConfig, "grid.")
    for name in ("losses", "batch_per_device", "seeds"):
        if name not in given:
            raise ConfigError(f"config: grid.{name} is required (compare needs losses, batch_per_device and seeds)")
    check_given(grid, given, "grid.")
    return grid


def check_given(obj: Any, given: dict, prefix: str) -> None:
    """Each key of `given` read into `obj` against its rule (a default passes its own); the keys of
    a group (grid.seeds_until: those without a default are required) and of a section (grid.slurm) too."""
    declared = {f.name: f for f in dataclasses.fields(obj)}
    for name, value in given.items():
        if "rule" in declared[name].metadata:  # a section (grid.slurm) is no key of its own
            declared[name].metadata["rule"].check(prefix + name, getattr(obj, name))
        if entries := entries_of(typing.get_type_hints(type(obj))[name]):
            setattr(obj, name, {n: read_entry(obj, entries, e, f"{prefix}{name}.{n}.") for n, e in value.items()})
        elif dataclasses.is_dataclass(group := getattr(obj, name)):
            hints = typing.get_type_hints(type(group))
            required = [f.name for f in dataclasses.fields(group)
                        if f.default is None and type(None) not in typing.get_args(hints[f.name])]
            missing = [k for k in required if getattr(group, k) is None]
            if missing:
                raise ConfigError(f"config: {prefix}{name} must give {', '.join(required)}; "
                                  f"{', '.join(missing)} missing, got {short(value)}")
            check_given(group, {k: v for k, v in value.items() if v is not None}, f"{prefix}{name}.")


def read_entry(section: Any, cls: type, given: dict, prefix: str) -> Any:
    """One entry of a key of names -> groups (entries_of): the `section`'s own keys of `cls`, with
    the keys `given` (unknown keys, types and rules refused in one line naming the dotted key) over them."""
    given = {k: v for k, v in given.items() if v is not None}
    own = from_dict(given, cls, prefix)
    check_given(own, given, prefix)
    inherited = {f.name: getattr(section, f.name) for f in dataclasses.fields(cls)}
    return cls(**{**inherited, **{k: getattr(own, k) for k in given}})


def get_dotted(tree: Any, dotted: str, missing: Any = AttributeError) -> Any:
    """tree.a.b (a Config) or tree["a"]["b"] (its dict) for 'a.b': the one walk that reads a
    dotted key. missing: returned where a part is absent (default: raise)."""
    for part in dotted.split("."):
        if isinstance(tree, dict) and part in tree:
            tree = tree[part]
        elif not isinstance(tree, dict) and hasattr(tree, part):
            tree = getattr(tree, part)
        elif missing is AttributeError:
            raise AttributeError(f"config has no key {dotted!r}")
        else:
            return missing
    return tree


RENAMED_VALUES: dict[str, dict[str, str]] = {"loss.temperature": {"infonce": "split"}}
"""Old values still read (older runs' configs and checkpoints), mapped to their new names: the
one home of a rename (configs and checkpoints' configs read it)."""


def current_value(key: str, value: Any) -> Any:
    """`value` of dotted `key` under its current name (RENAMED_VALUES), else unchanged."""
    return RENAMED_VALUES.get(key, {}).get(value, value) if isinstance(value, str) else value


def from_dict(data: dict, cls: type = Config, prefix: str = "") -> Any:
    """Build a dataclass tree from nested dicts, rejecting unknown keys and bad types."""
    if not isinstance(data, dict):
        raise ConfigError(f"config: {prefix.rstrip('.') or 'top level'} must be a mapping, got {short(data)}")
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    kwargs = {}
    for key, value in data.items():
        if key not in names:
            raise ConfigError(f"config: unknown key '{prefix}{key}' (valid: {', '.join(sorted(names))})")
        tp = hints[key]
        renamed = RENAMED_VALUES.get(f"{prefix}{key}", {})
        if isinstance(value, str) and value in renamed:
            print(f"vlp: note: {prefix}{key}={value} is now called {renamed[value]!r}", file=sys.stderr)
            value = renamed[value]
        if dataclasses.is_dataclass(tp):
            kwargs[key] = from_dict(value, tp, f"{prefix}{key}.")
        elif group_of(tp):  # a grid: key of its own keys; a null one is unset
            value = {k: v for k, v in value.items() if v is not None} if isinstance(value, dict) else value
            kwargs[key] = from_dict(value, group_of(tp), f"{prefix}{key}.")
        else:
            kwargs[key] = check_type(f"{prefix}{key}", value, tp)
    return cls(**kwargs)


def parse_overrides(overrides: Sequence[str], once: bool = False) -> list[tuple[str, Any]]:
    """(key, value) of each `a.b=value` override, the value parsed as YAML. Refused in one line:
    an item without '=' and one holding a line break (YAML would fold it into a space without a
    word). once: also two overrides of one key, or of a key and the section holding it, where
    the last would win without a word (`data.train_shards=A data.train_shards=B` trains on B
    alone): the rule of a user's command line (vlp.cli). Without it a later item replaces an
    earlier one (a program adding its own settings to a base list)."""
    pairs: list[tuple[str, Any]] = []
    given: dict[str, str] = {}  # key -> the override that set it
    for item in overrides:
        if "\n" in item or "\r" in item:
            raise ConfigError(f"config: override {short(item)} holds a line break: give each override on one line")
        if "=" not in item:
            raise ConfigError(f"config: override '{item}' must look like key.sub=value")
        key, raw = item.split("=", 1)
        for other, first in given.items() if once else ():
            if key == other or key.startswith(f"{other}.") or other.startswith(f"{key}."):
                raise ConfigError(f"config: overrides {short(first)} and {short(item)} both set "
                                  f"{max(key, other, key=len)}: give each key once")
        given[key] = item
        try:
            value = yaml.safe_load(raw) if raw != "" else None
        except yaml.YAMLError:
            value = raw
        pairs.append((key, value))
    return pairs


def apply_overrides(data: dict, overrides: Sequence[str], once: bool = False) -> dict:
    """Apply `a.b=value` overrides (parse_overrides, with its `once`) onto a nested dict, in order."""
    for key, value in parse_overrides(overrides, once):
        set_dotted(data, key, value)
    return data


def set_dotted(tree: dict, key: str, value: Any) -> None:
    """tree[a][b] = value for key 'a.b', creating sections; a key through a non-section is a
    ConfigError (the one walk for command-line, compare-grid and per-run overrides)."""
    node = tree
    parts = key.split(".")
    for part in parts[:-1]:
        node = node.setdefault(part, {})
        if not isinstance(node, dict):
            raise ConfigError(f"config: override '{key}': '{part}' is not a section")
    node[parts[-1]] = value


def flatten(tree: dict, prefix: str = "") -> dict[str, Any]:
    """{a: {b: 1}, 'c.d': 2} -> {'a.b': 1, 'c.d': 2} (overrides may come nested from the CLI)."""
    out = {}
    for key, value in tree.items():
        if isinstance(value, dict):
            out.update(flatten(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def stale_key(saved: dict, current: dict) -> Optional[str]:
    """First dotted key whose value differs between a run's saved config and the current one, but
    for HARMLESS_KEYS; keys only one side has are ignored: a field added to Config later keeps
    old runs valid."""
    a, b = flatten(saved), flatten(current)
    for key in sorted(set(a) & set(b)):
        if key not in HARMLESS_KEYS and a[key] != b[key]:
            return f"{key}: {a.get(key)!r} then, {b.get(key)!r} now"
    return None


def load_yaml(text: str, source: str = "config") -> Any:
    """Parse YAML like yaml.safe_load, but a mapping with a duplicate key is a ConfigError
    '<source>: duplicate key 'lr' on line 9 (first on line 4)' (for config, suite and compare files)."""
    try:
        return util.load_yaml(text)
    except util.DuplicateKey as e:
        raise ConfigError(f"config: {source}: {e}") from None


def read_config(path: Optional[str | Path] = None, overrides: Optional[list[str]] = None,
                once: bool = False) -> Config:
    """YAML file (optional) + dotted overrides (parse_overrides, with its `once`) → a Config of the
    right types, its rules not yet checked: commands use vlp.experiment.load_config, which checks
    them (Config.check_keys) and the registry's."""
    data: dict = {}
    if path is not None:
        path = Path(path)
        if not path.is_file():
            raise ConfigError(f"config: no such file: {path}")
        try:
            data = load_yaml(path.read_text(), str(path)) or {}
        except yaml.YAMLError as e:
            raise ConfigError(f"config: {path} is not valid YAML: {short(str(e).splitlines()[0], 200)}") from None
        except UnicodeDecodeError:
            raise ConfigError(f"config: {path} is not UTF-8 text") from None
        if not isinstance(data, dict):
            raise ConfigError(f"config: top level of {path} must be a mapping of sections, "
                              f"got {type(data).__name__} {short(data)}")
    data = apply_overrides(data, list(overrides or []), once)
    return from_dict(data)


def save_config(cfg: Config, path: str | Path) -> None:
    Path(path).write_text(yaml.safe_dump(cfg.to_dict(), sort_keys=False))
