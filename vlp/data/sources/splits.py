"""The fit / val / test split of every packaged source, by a stable hash of a pair's *name* (its
title, icon or emoji name, from which the caption is made): ~10 % 'eval' (= 'test'), ~10 % of the
rest 'val', the others 'fit' ('fit' + 'val' = 'train'). One caption per name, so the splits are
disjoint by caption."""

from __future__ import annotations

import hashlib

EVAL_PERCENT = 10
VAL_PERCENT = 10  # taken from the train names: hash % 100 in [EVAL_PERCENT, EVAL_PERCENT + VAL_PERCENT)
SPLITS = ("train", "eval", "all", "fit", "val", "test")


def stable_hash(text: str) -> int:
    """A process-independent 64-bit hash (Python's ``hash()`` is salted per process)."""
    return int.from_bytes(hashlib.sha1(text.encode("utf-8")).digest()[:8], "big")


def split_of(name: str) -> str:
    """'eval' for ~10 % of names (stable hash of the name), else 'train'."""
    return "eval" if stable_hash(name) % 100 < EVAL_PERCENT else "train"


def study_split(name: str) -> str:
    """'test' (= the 'eval' names), 'val' (~10 % of the 'train' names) or 'fit' (the rest)."""
    bucket = stable_hash(name) % 100
    if bucket < EVAL_PERCENT:
        return "test"
    return "val" if bucket < EVAL_PERCENT + VAL_PERCENT else "fit"


def in_split(name: str, stored: str, split: str) -> bool:
    """Whether a pair (its name, its stored 'train'/'eval' split) belongs to ``split``."""
    if split == "all":
        return True
    if split in ("train", "eval"):
        return stored == split
    return study_split(name) == split
