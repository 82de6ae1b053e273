"""The loss registry: names, lookup errors, and the one shared call signature."""

from __future__ import annotations

import inspect
import re

import pytest

from vlp.losses import LOSSES, get_loss


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
