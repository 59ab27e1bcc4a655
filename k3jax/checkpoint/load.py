"""One entry point for "give me a model from this directory": HF safetensors or k3jax Orbax."""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path

from k3jax.config import K3Config, RuntimeOptions

__all__ = ["load_model_dir", "is_orbax_dir", "load_config", "local_path"]


def local_path(path, what: str) -> Path:
    """`path` as a local Path. Checkpoint directories are read and written with local file
    APIs (pathlib, tensorstore's file driver): a URL would silently become a local
    `gs:/...` directory, so it is refused with the way round it."""
    if "://" in str(path):
        raise ValueError(f"{what} {path}: checkpoint directories must be local paths; mount the bucket "
                         f"(gcsfuse, e.g. /gcs/BUCKET/...) or use a shared filesystem. "
                         f"Training run directories (output_dir=) may be gs:// URLs.")
    return Path(path)


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


def load_model_dir(path, runtime: dict | None = None, shardings=None, *, vision: bool = False,
                   expert_format: str | None = None):
    """(K3Config, params) from an HF safetensors directory or a `k3jax convert` output.

    `expert_format` ('bf16' | 'mxfp4'; shorthand for runtime={'expert_format': ...}):
    'mxfp4' keeps the routed experts as MXFP4 bytes (uint8 packed codes and E8M0 scales,
    17/32 byte per value), read as stored from MXFP4 files and quantized from widened ones.

    `runtime`: RuntimeOptions overrides (e.g. {'param_dtype': 'bfloat16'}); every leaf is
    cast to the dtype the model uses for it under those options. Orbax checkpoints restore
    onto the first device, or with `shardings` (a function ModelConfig -> NamedSharding tree)
    straight onto those shardings, each host reading only its shards; HF directories are
    read into host memory first (fine for small models; convert big ones first).

    `vision`: also load the vision tower and projector, when the checkpoint has them, under
    params['vision'] (`k3jax.vision.multimodal`), in the text param dtype; with `shardings`
    they are replicated over the same mesh (0.45 B params in K3). Without, or when the
    checkpoint holds no vision weights, params are the text tree alone.
    """
    path = local_path(path, "checkpoint")
    if expert_format is not None:
        runtime = {**(runtime or {}), "expert_format": expert_format}
    k3 = load_config(path, runtime)
    if is_orbax_dir(path):
        from k3jax.checkpoint.convert import FORMAT, MANIFEST
        from k3jax.checkpoint.orbax_io import restore_params

        manifest = json.loads((path / MANIFEST).read_text())
        if manifest.get("format") != FORMAT:
            raise ValueError(f"{path / MANIFEST}: format {manifest.get('format')!r}, expected {FORMAT!r}")
        text_shardings = None if shardings is None else shardings(k3.text)
        stored = manifest.get("expert_format", "bf16")
        if stored == k3.text.runtime.expert_format:
            params = restore_params(path, k3.text, text_shardings)
        else:   # restored as converted, then widened or quantized onto the asked format
            as_stored = k3.text.with_runtime(expert_format=stored)
            params = restore_params(path, as_stored, None if shardings is None else shardings(as_stored))
            params = convert_experts(params, k3.text.runtime.expert_format, text_shardings)
        if vision and k3.vision is not None and (path / "vision" / "_METADATA").exists():
            from k3jax.checkpoint.orbax_io import restore_tree
            abstract = _vision_abstract(k3)
            params["vision"] = restore_tree(path / "vision", abstract, _replicated(abstract, text_shardings))
        return k3, params
    if (path / "params" / "_METADATA").exists():
        raise ValueError(f"{path}: has params/ but no manifest: an unfinished conversion?")
    import jax
    import numpy as np
    from flax import linen as nn

    from k3jax.checkpoint.hf_params import load_hf_params
    from k3jax.model import abstract_params

    params = load_hf_params(k3.text, path)
    dtypes = nn.unbox(abstract_params(k3.text))
    params = jax.tree.map(lambda a, s: np.asarray(a, s.dtype), params, dtypes)
    text_shardings = None if shardings is None else shardings(k3.text)
    if text_shardings is not None:
        params = jax.tree.map(jax.device_put, params, text_shardings)
    if vision and k3.vision is not None and _has_vision_tensors(path):
        from k3jax.vision.vision_names import load_vision_params
        abstract = _vision_abstract(k3)
        tree = load_vision_params(k3.vision, path, np.float32)
        tree = jax.tree.map(lambda a, s: np.asarray(a, s.dtype), tree, abstract)
        if text_shardings is not None:
            tree = jax.tree.map(jax.device_put, tree, _replicated(abstract, text_shardings))
        params["vision"] = tree
    return k3, params


def convert_experts(params, expert_format: str, shardings=None):
    """Every routed-expert stack of `params` turned into `expert_format`: MXFP4 pairs
    widened ('bf16', to the dtype of the tree's other matrices) or widened stacks quantized
    ('mxfp4', compressed-tensors' rule; a stack that came from MXFP4 gets its bytes back,
    up to the scale byte of all-zero groups, which no value records)."""
    import jax
    import jax.numpy as jnp

    from k3jax.ops.mxfp4 import MXFP4, dequantize_experts, quantize_mxfp4_jax

    def walk(node, dtype):
        if not isinstance(node, dict):
            return node
        out = {}
        for k, v in node.items():
            if k in ("w1", "w2", "w3") and expert_format == "bf16" and isinstance(v, dict):
                out[k] = dequantize_experts(MXFP4(v["weight_packed"], v["weight_scale"]), dtype)
            elif k in ("w1", "w2", "w3") and expert_format == "mxfp4" and not isinstance(v, dict):
                packed, scale = quantize_mxfp4_jax(jnp.swapaxes(v, -1, -2))
                out[k] = {"weight_packed": packed, "weight_scale": scale}
            else:
                out[k] = walk(v, dtype)
        return out

    dtype = params["embed_tokens"]["embedding"].dtype
    return jax.jit(lambda p: walk(p, dtype), out_shardings=shardings)(params)


def _vision_abstract(k3: K3Config):
    from k3jax.layers.common import param_dtype
    from k3jax.layers.vision import vision_param_shapes
    return vision_param_shapes(k3.vision, param_dtype(k3.text))


def _replicated(abstract, text_shardings):
    """The vision tree replicated over the mesh of the text shardings (None: first device)."""
    if text_shardings is None:
        return None
    import jax
    mesh = jax.tree.leaves(text_shardings)[0].mesh
    rep = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    return jax.tree.map(lambda _: rep, abstract)


def _has_vision_tensors(path: Path) -> bool:
    from k3jax.checkpoint.safetensors_io import ShardedCheckpoint
    from k3jax.vision.vision_names import PREFIXES
    ckpt = ShardedCheckpoint(path)
    try:
        return any(n.startswith(PREFIXES) for n in ckpt.keys())
    finally:
        ckpt.close()
