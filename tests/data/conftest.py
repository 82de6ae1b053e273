"""Shared fixtures: OpenMoji rendered once per session into a private cache."""

from __future__ import annotations

from pathlib import Path

import pytest

from vlp.data.sources import openmoji


@pytest.fixture(scope="session")
def openmoji_cache(tmp_path_factory) -> Path:
    """A private cache so tests never depend on (or pollute) the repo's .cache."""
    cache = tmp_path_factory.mktemp("openmoji-cache")
    openmoji.ensure_rendered(64, cache)
    return cache


@pytest.fixture(scope="session")
def openmoji_all(openmoji_cache):
    return openmoji.load_pairs("all", cache_dir=openmoji_cache)


@pytest.fixture(scope="session")
def small_pairs(openmoji_all):
    """50 pairs spread over the whole set."""
    step = len(openmoji_all) // 50
    return openmoji_all[::step][:50]
