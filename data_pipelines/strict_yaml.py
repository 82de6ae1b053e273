"""YAML as yaml.safe_load reads it, except that a mapping with the same key twice is refused
(every YAML file vlp reads: configs, compare grids, eval suites)."""

from __future__ import annotations

from typing import Any

import yaml


class DuplicateKey(ValueError):
    """'duplicate key 'lr' on line 9 (first on line 4)'."""


def _short(key: Any, limit: int = 60) -> str:
    text = repr(key)
    return text if len(text) <= limit else text[:limit] + "..."


class _UniqueKeyLoader(yaml.SafeLoader):
    """yaml.SafeLoader that refuses a mapping with the same key twice (PyYAML keeps the last one
    silently: `lr: 1e-3` ... `lr: 1e-5` would train with whichever came second)."""


def _unique_mapping(loader: _UniqueKeyLoader, node: yaml.MappingNode, deep: bool = False) -> dict:
    seen: dict = {}
    for key_node, _ in node.value:  # the keys written here (a key may override one merged by <<)
        if key_node.tag == "tag:yaml.org,2002:merge":
            continue
        key = loader.construct_object(key_node, deep=True)
        line = key_node.start_mark.line + 1
        try:
            if key in seen:
                raise DuplicateKey(f"duplicate key {_short(key)} on line {line} (first on line {seen[key]})")
            seen[key] = line
        except TypeError:  # an unhashable key: the base constructor names it
            break
    return yaml.SafeLoader.construct_mapping(loader, node, deep)


_UniqueKeyLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _unique_mapping)


def load(text: str) -> Any:
    """Parse `text`; DuplicateKey names the key and both lines."""
    return yaml.load(text, Loader=_UniqueKeyLoader)
