"""Reading config files: YAML with duplicate keys refused and errors as `path:line:col`,
JSON likewise, and `extends:`'s deep merge (what k3jax.config and the mesh presets share)."""
from __future__ import annotations

import json
import os

import yaml

from k3jax.errors import ConfigError


def read_json_or_dict(path_or_dict) -> dict:
    if isinstance(path_or_dict, dict):
        return path_or_dict
    path = os.fspath(path_or_dict)
    if os.path.isdir(path):
        path = os.path.join(path, "config.json")
    with open(path) as f:
        text = f.read()
    d = parse_yaml(text, path) if path.endswith((".yaml", ".yml")) else parse_json(text, path)
    if not isinstance(d, dict):
        raise ConfigError(f"{path}: a config must be a mapping, got {type(d).__name__}")
    return d


# libyaml's parser where PyYAML was built with it (the same YAML, the same Python constructor
# and resolver below): a planner call reads every mesh preset, and the pure-Python scanner
# was half of a warm `k3jax plan`
_SafeLoader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)


class _UniqueKeyLoader(_SafeLoader):
    """safe_load that refuses a key given twice in one mapping (PyYAML keeps the last)."""

    def construct_mapping(self, node, deep=False):
        seen = set()
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=True)
            if key in seen:
                raise yaml.constructor.ConstructorError(
                    None, None, f"key {key!r} given twice in one mapping", key_node.start_mark)
            seen.add(key)
        return super().construct_mapping(node, deep)


def deep_merge(base: dict, over: dict) -> dict:
    """`over` onto `base`: mappings merge key by key at every depth, anything else (lists,
    scalars, a mapping replacing a non-mapping) is replaced whole."""
    out = dict(base)
    for key, value in over.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = deep_merge(out[key], value)
        else:
            out[key] = value
    return out


def parse_yaml(text: str, path: str):
    """YAML with syntax errors reported as `path:line:column: ...` (one line)."""
    try:
        return yaml.load(text, Loader=_UniqueKeyLoader)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f"{path}:{mark.line + 1}:{mark.column + 1}" if mark is not None else path
        what = " ".join(str(getattr(e, "problem", None) or e).split())
        raise ConfigError(f"{where}: YAML syntax error: {what}") from None


def parse_json(text: str, path: str):
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise ConfigError(f"{path}:{e.lineno}:{e.colno}: JSON syntax error: {e.msg}") from None
