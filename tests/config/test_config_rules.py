"""Each config key is declared once (issue 27): its field carries type, default, validation rule
and resume rule (vlp.config.rules.key), and the tables are read from the fields. One table-driven
test over every key: the default passes, a value of a wrong type is refused, and every `bad`
value of its rule is refused with one line naming the key, the value and what is allowed.
"""

import copy
import dataclasses
import math
import typing
from dataclasses import dataclass

import pytest

from vlp.config import GRID_KEYS, KEYS, RULES, Config, ConfigError, declared_keys, from_dict

from vlp.experiment import check
from vlp.experiment import load_config
from vlp.config.rules import APPLIED, COUNT, KeyRule, Rule, key, number
from vlp.checkpoint.resume import RESUME_RULES
from vlp.study.grid import parse_grid


def _leaves(obj, prefix=""):
    """Dotted name -> value of every leaf of a config tree, walked without vlp.config's helpers."""
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        if dataclasses.is_dataclass(value):
            yield from _leaves(value, f"{prefix}{f.name}.")
        else:
            yield f"{prefix}{f.name}", value


DEFAULTS = dict(_leaves(Config()))
FIELDS = {name: k.type for name, k in KEYS.items()}


def test_every_key_is_read_from_its_field_with_a_rule_and_a_resume_rule():
    assert list(KEYS) == list(DEFAULTS)  # every leaf field, in declaration order
    for name, k in KEYS.items():
        section, field_name = name.split(".")
        f = next(f for f in dataclasses.fields(type(getattr(Config(), section))) if f.name == field_name)
        assert isinstance(k.rule, Rule) and isinstance(k.resume, KeyRule), name
        assert RULES[name] is f.metadata["rule"] is k.rule, name
        assert RESUME_RULES[name] is f.metadata["resume"] is k.resume, name
        assert k.default == f.default == DEFAULTS[name], name
        assert k.type == typing.get_type_hints(type(getattr(Config(), section)))[field_name], name
    assert list(RULES) == list(RESUME_RULES) == list(KEYS)


def test_a_field_declared_without_key_is_refused_by_name():
    @dataclass
    class Section:
        declared: int = key(1, COUNT, APPLIED)
        plain: int = 3

    @dataclass
    class Good:
        declared: int = key(1, COUNT, APPLIED)

    with pytest.raises(TypeError, match=r"config key part\.plain is declared without vlp.config.rules.key"):
        list(declared_keys(Section, "part."))
    (only,) = declared_keys(Good, "part.")
    assert (only.name, only.type, only.default, only.rule, only.resume) == ("part.declared", int, 1, COUNT, APPLIED)


def _nested(key, value) -> dict:
    section, name = key.split(".")
    return {section: {name: value}}


def _wrong_type(tp):
    """A value no field of type `tp` may take."""
    return {"x": 1} if tp is not str and str not in typing.get_args(tp) else [1, 2]


@pytest.mark.parametrize("key", sorted(FIELDS))
def test_field_refuses_bad_values_in_one_line(key):
    rule = RULES[key]
    cases = [(v, True) for v in rule.bad] + [(_wrong_type(FIELDS[key]), False)]
    for value, by_rule in cases:
        with pytest.raises(ConfigError) as e:
            check(from_dict(_nested(key, value)))
        msg = str(e.value)
        assert "\n" not in msg and msg.startswith("config: "), msg
        assert key in msg, msg
        if by_rule:  # the rule's message: key, value, what is allowed
            shown = repr(value)
            assert f"{key} must be {rule.allowed}, got {shown}" in msg, msg


GRID = {"losses": ["infonce"], "batch_per_device": [8], "seeds": [0], "sweep": {"optim.lr": [1e-3]},
        "accum_price": {"batch_per_device": 4, "accum_steps": 2, "samples": 16},
        "seeds_until": {"half_width": 1.0, "max_seeds": 8, "step": 2}}
"""A study's grid: that passes, with every group of its own keys (grid.seeds_until) given."""


def _grid_with(key: str, value) -> dict:
    """GRID with dotted grid key `key` (grid.seeds_until.step too) set to `value`."""
    raw = copy.deepcopy(GRID)
    *groups, leaf = key.split(".")[1:]
    node = raw
    for group in groups:
        node = node.setdefault(group, {})  # a section (grid.slurm) given only for this key
    node[leaf] = value
    return raw


def test_the_grid_keys_include_the_groups_own_keys():
    parse_grid(copy.deepcopy(GRID))
    assert {"grid.seeds_until.half_width", "grid.seeds_until.max_seeds", "grid.seeds_until.step",
            "grid.accum_price.batch_per_device", "grid.accum_price.seeds", "grid.sweep_bounds"} <= set(GRID_KEYS)


@pytest.mark.parametrize("key", sorted(GRID_KEYS))
def test_grid_key_refuses_bad_values_in_one_line(key):
    """Every grid: key, the groups' own keys included: each `bad` value of its rule, and a value
    of a wrong type, refused with one line naming the key."""
    rule = GRID_KEYS[key].rule
    cases = [(v, True) for v in rule.bad] + [(_wrong_type(GRID_KEYS[key].type), False)]
    for value, by_rule in cases:
        with pytest.raises(ConfigError) as e:
            parse_grid(_grid_with(key, value))
        msg = str(e.value)
        assert "\n" not in msg and msg.startswith("config: ") and key in msg, msg
        if by_rule and rule.problem is None:  # the rule's message: key, value, what is allowed
            assert f"{key} must be {rule.allowed}, got {value!r}" in msg, msg


@pytest.mark.parametrize("key, value, message", [  # a group's keys: unknown, missing, of a wrong type
    ("grid.seeds_until.steps", 2, "config: unknown key 'grid.seeds_until.steps' (valid: half_width, max_seeds, step)"),
    ("grid.seeds_until.step", None, "config: grid.seeds_until must give half_width, max_seeds, step; step missing"),
    ("grid.accum_price.samples", "many", "config: grid.accum_price.samples must be int, got str 'many'"),
    ("grid.seeds_until", [1], "config: grid.seeds_until must be a mapping, got [1]"),
])
def test_grid_group_lines(key, value, message):
    with pytest.raises(ConfigError) as e:
        parse_grid(_grid_with(key, value))
    assert str(e.value).startswith(message) and "\n" not in str(e.value)


@pytest.mark.parametrize("override, needle", [
    ("optim.lr=inf", "optim.lr must be finite and > 0, got inf"),
    ("optim.lr=.nan", "optim.lr must be finite and > 0, got nan"),
    ("loss.max_logit_scale=nan", "loss.max_logit_scale must be finite and >= 1, got nan"),
    ("optim.grad_clip=-1", "optim.grad_clip must be finite and > 0, got -1.0"),
    ("optim.weight_decay=-1", "optim.weight_decay must be finite and >= 0, got -1.0"),
    ("loss.tau=inf", "loss.tau must be finite and > 0 and <= 1, got inf"),
    ("data.shuffle_buffer=-1", "data.shuffle_buffer must be > 0, got -1"),
    ("train.max_nonfinite=0", "train.max_nonfinite must be > 0, got 0"),
    ("train.samples=inf", "train.samples must be int, got float inf"),
    ("loss.tau=0.001", "above loss.max_logit_scale=100.0"),
])
def test_issue_values_via_overrides(override, needle):
    with pytest.raises(ConfigError) as e:
        load_config(None, [override])
    assert needle in str(e.value) and "\n" not in str(e.value)


KNOWN = "(known: pypi:efficientnet-lite0, pypi:all-minilm-l6-v2)"


@pytest.mark.parametrize("overrides, message", [  # the whole line, as before the keys moved onto the fields
    (["model.pretrained=pypi:nope"], f"config: model.pretrained: unknown packaged tower 'pypi:nope' {KNOWN}"),
    (["model.hf_text_dir=pypi:nope"], f"config: model.hf_text_dir: unknown packaged tower 'pypi:nope' {KNOWN}"),
    (["train.output_dir=" + "x" * 300], "config: train.output_dir has a path component of 300 bytes "
     f"('{'x' * 36}...); the file system allows 255"),
    (["train.output_dir=" + "/".join(["abc"] * 1500)], "config: train.output_dir is 5999 bytes long; paths are "
     "limited to 4095"),
    (["train.parallel=fsdp", "train.precision=fp16"], "config: train.parallel=fsdp does not support "
     "train.precision=fp16 (use bf16)"),
    (["loss.name=siglip", "loss.temperature=split"], "config: loss.temperature=split only applies to "
     "loss.name=flatnce or sogclr or dcl"),
    (["loss.tau=0.001"], "config: loss.tau=0.001 gives initial logit_scale 1000 above loss.max_logit_scale=100.0: "
     "the clamp would change it silently; raise loss.max_logit_scale or set tau"),
    (["data.feature_cache=memory", "data.train_transform=eval", "model.lock_image=true", "model.lock_text=true",
      "train.parallel=fsdp"], "config: data.feature_cache supports train.parallel=ddp only"),
    (["train.seed=-1"], "config: train.seed must be >= 0 and <= 4.29497e+09, got -1"),
    (["loss.name=3"], "config: loss.name must be str, got int 3"),
    (["loss.name=nce"], "config: loss.name must be one of ['infonce', 'flatnce', 'siglip', 'sogclr', 'dcl', 'fastclip', 'isogclr'], got 'nce'"),
])
def test_whole_error_lines(overrides, message):
    with pytest.raises(ConfigError) as e:
        load_config(None, overrides)
    assert str(e.value) == message


@pytest.mark.parametrize("text", ["- a\n- b\n", "3\n", "just a string\n"])
def test_yaml_top_level_must_be_a_mapping(tmp_path, text):
    path = tmp_path / "c.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError, match="top level of .* must be a mapping"):
        load_config(path, ["optim.lr=1e-3"])


def test_number_rule_edges():
    r = number(0, 1, hi_open=True)
    assert r.ok(0) and r.ok(0.999) and not r.ok(1) and not r.ok(-1e-9) and not r.ok(math.nan)
    assert set(map(repr, r.bad)) == {"nan", "inf", "-inf", "-0.5", "1"}


def test_the_keys_page_is_in_step_with_the_declarations():
    """docs/configuration.md lists every key as vlp/config/keys.py declares it (scripts/config_keys.py)."""
    import importlib.util

    from vlp_testing import REPO

    spec = importlib.util.spec_from_file_location("config_keys_script", REPO / "scripts" / "config_keys.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    page = script.PAGE.read_text()
    assert script.with_keys(page) == page, "docs/configuration.md is out of step: run python scripts/config_keys.py"
    table = script.keys_markdown()
    assert all(f"| `{name}` |" in table for name in {**KEYS, **GRID_KEYS})  # grid.seeds_until.step too
    assert "| `data.batch_per_device` | int | `64` | > 0 | layout: refused when exact, applied when continue |" in table
    assert "| `loss.tau` | float or null | null | finite and > 0 and &lt;= 1 | refused (logit_scale comes from the " \
           "checkpoint) |" in table
