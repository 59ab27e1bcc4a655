"""Smaller or wider variants of a preset, for tests and benchmarks (same schema, same code)."""
from __future__ import annotations

import copy
import json
import os

import yaml

from k3jax.config import preset_path


def variant_dict(base: str = "toy", layers: tuple[str, ...] | None = None, train: dict | None = None,
                 **text) -> dict:
    """The preset's YAML dict with text_config keys replaced. `layers` ('kda'/'mla' per layer)
    rewrites the 1-based KDA / full-attention layer lists; `train` replaces the train section."""
    path = preset_path(base) if not os.path.exists(base) else base
    with open(path) as f:
        # JSON through json: PyYAML reads JSON's 1e-05 (no dot) as a string
        d = json.load(f) if path.endswith(".json") else yaml.safe_load(f)
    d = copy.deepcopy(d)
    tc = d["text_config"]
    if layers is not None:
        tc["num_hidden_layers"] = len(layers)
        tc["linear_attn_config"]["kda_layers"] = [i + 1 for i, k in enumerate(layers) if k == "kda"]
        tc["linear_attn_config"]["full_attn_layers"] = [i + 1 for i, k in enumerate(layers) if k == "mla"]
    for key, value in text.items():
        if key in tc.get("linear_attn_config", {}) and key not in tc:
            tc["linear_attn_config"][key] = value
        else:
            tc[key] = value
    if train is not None:
        d["train"] = train
    return d


def write_variant(path: str, **kwargs) -> str:
    with open(path, "w") as f:
        yaml.safe_dump(variant_dict(**kwargs), f, sort_keys=False)
    return path
