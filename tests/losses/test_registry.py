"""The loss registry: names, lookup errors, and the one shared call signature."""

from __future__ import annotations

import inspect
import re

import pytest

from vlp.losses.registry import STATELESS, get_loss

LOSSES = {name: get_loss(name) for name in STATELESS}  # the stateless losses by name


@pytest.mark.parametrize("name", ["infonce", "flatnce", "siglip", "dcl"])
def test_each_name_finds_the_loss_of_its_file(name):
    """One loss per file, registered under the file's name: a swapped entry would train another loss."""
    fn = get_loss(name)
    assert fn.__module__ == f"vlp.losses.{name}" and fn.__name__ == f"{name}_loss"


def test_unknown_name_lists_the_valid_ones():
    with pytest.raises(ValueError, match=re.escape(f"unknown loss 'clip'; valid: {sorted(LOSSES)}")):
        get_loss("clip")


def test_one_signature():
    signatures = {name: inspect.signature(fn) for name, fn in LOSSES.items()}
    first = signatures["infonce"]
    assert list(first.parameters) == [
        "img_local", "txt_local", "img_global", "txt_global", "logit_scale", "logit_bias",
        "offset", "scale_grad",
    ]
    assert all(sig == first for sig in signatures.values())


def test_compare_grids_name_every_registered_loss():
    """`vlp compare` takes its loss names from the registry: a grid of the new losses expands to
    one run per loss, each a valid config with that loss and its default temperature mode."""
    from vlp.losses.registry import NAMES
    from vlp.losses.registry import get_spec
    from vlp.study.grid import parse_grid
    from vlp.study.plan import sweep_runs
    from vlp.study.runs import run_config

    assert {"dcl", "fastclip", "isogclr"} <= set(NAMES)
    grid = parse_grid({"losses": ["dcl", "fastclip", "isogclr"], "batch_per_device": [8], "seeds": [0],
                       "loss_overrides": {"isogclr": {"loss.rho": 1.0, "loss.tau_lr": 1e-3}}})
    runs = {r.arm.loss: r for r in sweep_runs(grid)}
    assert sorted(runs) == ["dcl", "fastclip", "isogclr"]
    for name, run in runs.items():
        cfg = run_config({"train": {"samples": 64}}, grid, run)
        assert cfg.loss.name == name and cfg.loss.temperature == get_spec(name).temperature
    iso = run_config({"train": {"samples": 64}}, grid, runs["isogclr"]).loss
    assert (iso.rho, iso.tau_lr) == (1.0, 1e-3)
