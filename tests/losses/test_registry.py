"""The loss registry: names, lookup errors, and the one shared call signature."""

from __future__ import annotations

import inspect

import pytest

from vlp.losses import LOSSES, flatnce_loss, get_loss, infonce_loss, siglip_loss


def test_names_and_lookup():
    assert LOSSES == {"infonce": infonce_loss, "flatnce": flatnce_loss, "siglip": siglip_loss}
    assert get_loss("flatnce") is flatnce_loss
    with pytest.raises(ValueError, match=r"\['flatnce', 'infonce', 'siglip'\]"):
        get_loss("clip")


def test_one_signature():
    signatures = {name: inspect.signature(fn) for name, fn in LOSSES.items()}
    first = signatures["infonce"]
    assert list(first.parameters) == [
        "img_local", "txt_local", "img_global", "txt_global", "logit_scale", "logit_bias",
        "offset", "scale_grad",
    ]
    assert all(sig == first for sig in signatures.values())
