"""One table-driven test over every field of every config dataclass (issue 15, item 3).

Each field must have a rule in `vlp.config.RULES`: a new field without one fails here. For each
field: the default passes, a value of a wrong type is refused, and every `bad` value of its rule
is refused with one line naming the key, the value and what is allowed.
"""

import dataclasses
import math
import typing

import pytest

from vlp.config import RULES, Config, ConfigError, from_dict


def _fields(cls=Config, prefix=""):
    """Dotted names and types of every leaf field of the config tree."""
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        tp = hints[f.name]
        if dataclasses.is_dataclass(tp):
            yield from _fields(tp, f"{prefix}{f.name}.")
        else:
            yield f"{prefix}{f.name}", tp


FIELDS = dict(_fields())


def _nested(key, value) -> dict:
    section, name = key.split(".")
    return {section: {name: value}}


def _wrong_type(tp):
    """A value no field of type `tp` may take."""
    return {"x": 1} if tp is not str and str not in typing.get_args(tp) else [1, 2]


def test_every_field_has_a_rule_and_every_rule_a_field():
    assert sorted(set(FIELDS) - set(RULES)) == [], "fields without a rule in vlp.config.RULES"
    assert sorted(set(RULES) - set(FIELDS)) == [], "rules for fields that do not exist"


def test_defaults_pass():
    Config().validate()


@pytest.mark.parametrize("key", sorted(FIELDS))
def test_field_refuses_bad_values_in_one_line(key):
    rule = RULES[key]
    cases = [(v, True) for v in rule.bad] + [(_wrong_type(FIELDS[key]), False)]
    for value, by_rule in cases:
        with pytest.raises(ConfigError) as e:
            from_dict(_nested(key, value)).validate()
        msg = str(e.value)
        assert "\n" not in msg and msg.startswith("config: "), msg
        assert key in msg, msg
        if by_rule:  # the rule's message: key, value, what is allowed
            shown = repr(value)
            assert f"{key} must be {rule.allowed}, got {shown}" in msg, msg


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
    from vlp.config import load_config

    with pytest.raises(ConfigError) as e:
        load_config(None, [override])
    assert needle in str(e.value) and "\n" not in str(e.value)


@pytest.mark.parametrize("text", ["- a\n- b\n", "3\n", "just a string\n"])
def test_yaml_top_level_must_be_a_mapping(tmp_path, text):
    from vlp.config import load_config

    path = tmp_path / "c.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError, match="top level of .* must be a mapping"):
        load_config(path, ["optim.lr=1e-3"])


def test_number_rule_edges():
    from vlp.config import number

    r = number(0, 1, hi_open=True)
    assert r.ok(0) and r.ok(0.999) and not r.ok(1) and not r.ok(-1e-9) and not r.ok(math.nan)
    assert set(map(repr, r.bad)) == {"nan", "inf", "-inf", "-0.5", "1"}
