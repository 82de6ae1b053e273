"""OpenMoji source: enough real pairs, no blank images, a stable disjoint split."""

from __future__ import annotations
import pytest

import io
import os

import numpy as np
from PIL import Image

from vlp.data.sources import openmoji


def test_enough_pairs_with_captions(openmoji_all):
    assert len(openmoji_all) >= 1800
    keys = [p.key for p in openmoji_all]
    assert len(set(keys)) == len(keys)
    assert all(p.caption.strip() and p.meta["name"] in p.caption for p in openmoji_all)
    assert all(k.replace("-", "").replace("_", "").isalnum() for k in keys)


def test_no_blank_images(openmoji_all):
    for pair in openmoji_all:
        pixels = np.asarray(Image.open(io.BytesIO(pair.image)).convert("RGB"))
        assert pixels.shape == (64, 64, 3)
        assert pixels.std() > 0 and pixels.min() < 255, pair.key


def test_split_disjoint_by_name_about_ten_percent(openmoji_cache):
    train = openmoji.load_pairs("train", cache_dir=openmoji_cache)
    held_out = openmoji.load_pairs("eval", cache_dir=openmoji_cache)
    names_train = {p.meta["name"] for p in train}
    names_eval = {p.meta["name"] for p in held_out}
    assert not names_train & names_eval
    assert 0.07 < len(held_out) / (len(train) + len(held_out)) < 0.13


def test_deterministic_and_cached(openmoji_cache, openmoji_all, tmp_path):
    again = openmoji.load_pairs("all", cache_dir=openmoji_cache)
    assert [(p.key, p.caption, p.image) for p in again] == \
        [(p.key, p.caption, p.image) for p in openmoji_all]
    # A fresh render elsewhere gives identical captions and pixels (first 40 compared).
    fresh = openmoji.load_pairs("all", cache_dir=tmp_path)
    assert [(p.key, p.caption) for p in fresh] == [(p.key, p.caption) for p in openmoji_all]
    for a, b in zip(fresh[:40], openmoji_all[:40]):
        assert Image.open(io.BytesIO(a.image)).tobytes() == \
            Image.open(io.BytesIO(b.image)).tobytes()


def test_caption_names():
    assert openmoji.caption_name(":red_heart:", "\u2764\ufe0f") == "red heart"
    assert openmoji.caption_name(":France:", "\U0001F1EB\U0001F1F7") == "flag of France"
    assert openmoji.caption_for("emoji_2764-fe0f", "red heart") in \
        [t.format(name="red heart") for t in openmoji.TEMPLATES]


@pytest.mark.multiproc
def test_split_of_is_a_fixed_function_of_the_name():
    """The held-out names are a contract (results compare across machines and releases): golden
    values, the same in a process with another hash salt, and ~10 % of names held out."""
    import subprocess
    import sys

    golden = {"red heart": "train", "flag of France": "train", "grinning face": "eval", "cat": "train"}
    assert {n: openmoji.split_of(n) for n in golden} == golden
    code = f"from vlp.data.sources.openmoji import split_of; print([split_of(n) for n in {list(golden)!r}])"
    for salt in ("1", "2"):
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                             env={**os.environ, "PYTHONHASHSEED": salt}).stdout
        assert out.strip() == repr(list(golden.values()))
    held = sum(openmoji.split_of(f"name {i}") == "eval" for i in range(1000))
    assert 70 <= held <= 130  # binomial(1000, 0.1): mean 100, sd 9.5


def test_unrenderable_is_rejected(openmoji_cache):
    renderer = openmoji.Renderer(64)
    assert renderer.render("\U0001F600") is not None
    assert renderer.render("\U000F0000") is None  # not in the font
    assert renderer.render("\U0001F600\U0001F600") is None  # two glyphs, not one emoji
