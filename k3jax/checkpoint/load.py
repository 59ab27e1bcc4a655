"""One entry point for "give me a model from this directory": HF safetensors or k3jax Orbax."""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path

from k3jax.config import K3Config, RuntimeOptions

__all__ = ["load_model_dir", "is_orbax_dir", "load_config"]


def is_orbax_dir(path) -> bool:
    """A finished `k3jax convert` output (the manifest is written last)."""
    from k3jax.checkpoint.convert import MANIFEST
    return (Path(path) / MANIFEST).is_file()


def load_config(path, runtime: dict | None = None) -> K3Config:
    path = Path(path)
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"{path}: no config.json (expected an HF checkpoint or a k3jax convert output)")
    k3 = K3Config.from_hf(path / "config.json")
    if runtime:
        unknown = sorted(set(runtime) - {f.name for f in dataclasses.fields(RuntimeOptions)})
        if unknown:
            raise ValueError(f"unknown runtime option(s) {unknown}")
        k3 = dataclasses.replace(k3, text=k3.text.with_runtime(**runtime))
    return k3


def load_model_dir(path, runtime: dict | None = None, shardings=None):
    """(K3Config, params) from an HF safetensors directory or a `k3jax convert` output.

    `runtime`: RuntimeOptions overrides (e.g. {'param_dtype': 'bfloat16'}); every leaf is
    cast to the dtype the model uses for it under those options. Orbax checkpoints restore
    onto the first device, or with `shardings` (a function ModelConfig -> NamedSharding tree)
    straight onto those shardings, each host reading only its shards; HF directories are
    read into host memory first (fine for small models; convert big ones first).
    """
    import numpy as np

    path = Path(path)
    k3 = load_config(path, runtime)
    if is_orbax_dir(path):
        from k3jax.checkpoint.convert import FORMAT, MANIFEST
        from k3jax.checkpoint.orbax_io import restore_params

        manifest = json.loads((path / MANIFEST).read_text())
        if manifest.get("format") != FORMAT:
            raise ValueError(f"{path / MANIFEST}: format {manifest.get('format')!r}, expected {FORMAT!r}")
        return k3, restore_params(path, k3.text, None if shardings is None else shardings(k3.text))
    if (path / "params" / "_METADATA").exists():
        raise ValueError(f"{path}: has params/ but no manifest: an unfinished conversion?")
    import jax
    from flax import linen as nn

    from k3jax.checkpoint.hf_params import load_hf_params
    from k3jax.model import abstract_params

    params = load_hf_params(k3.text, path)
    dtypes = nn.unbox(abstract_params(k3.text))
    params = jax.tree.map(lambda a, s: np.asarray(a, s.dtype), params, dtypes)
    if shardings is not None:
        params = jax.tree.map(jax.device_put, params, shardings(k3.text))
    return k3, params
