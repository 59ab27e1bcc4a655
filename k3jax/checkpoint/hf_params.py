"""Hugging Face safetensors directory → k3jax param tree (host numpy), via `names.tensor_map`.

Every tensor of the text model must be found, every text tensor in the files must be
mapped, and every shape must agree — otherwise the error names the tensor. Vision and
projector tensors are left to the vision loader.
"""
from __future__ import annotations

import numpy as np

from k3jax.checkpoint.mxfp4 import dequantize_mxfp4_np, quantize_mxfp4
from k3jax.checkpoint.names import TensorEntry, hf_prefixes, tensor_map, vision_names
from k3jax.checkpoint.vision_names import PREFIXES as VISION_PREFIXES
from k3jax.checkpoint.safetensors_io import ShardedCheckpoint
from k3jax.config import ModelConfig, VisionConfig
from k3jax.errors import K3JaxError

NON_TEXT_PREFIXES = VISION_PREFIXES
FLOAT_DTYPES = ("F32", "BF16", "F16", "F64")


class CheckpointMismatch(K3JaxError):
    """The checkpoint's tensors do not match the config; the message lists which."""


def detect_layout(names) -> str:
    names = list(names)
    if any(n.startswith("language_model.") for n in names):
        return "k3"
    if any(n.startswith("model.") for n in names):
        return "kimi_linear"
    raise CheckpointMismatch("checkpoint has neither 'language_model.*' (K3) nor 'model.*' (Kimi-Linear) tensors")


def detect_dense_mlp_name(names, layout: str, cfg: ModelConfig) -> str:
    """'mlp' (released files) or 'block_sparse_moe' (transformers' save_pretrained)."""
    pre, _ = hf_prefixes(layout)
    dense = [i for i, k in enumerate(cfg.ffn_kinds) if k == "dense"]
    if dense and f"{pre}layers.{dense[0]}.block_sparse_moe.gate_proj.weight" in set(names):
        return "block_sparse_moe"
    return "mlp"


def to_tree_layout(entry: TensorEntry, arr: np.ndarray, target_shape: tuple[int, ...]) -> np.ndarray:
    """Checkpoint array → the slice of the tree leaf it fills."""
    t = entry.transform
    if t in ("T", "expertT"):
        arr = arr.T
    elif t == "conv":
        arr = arr.reshape(arr.shape[0], arr.shape[-1]).T
    elif t == "row":
        arr = arr.reshape(-1)
    elif t == "a_log":
        h = target_shape[0]
        flat = arr.reshape(-1)
        if flat.shape[0] < h:
            raise CheckpointMismatch(f"{entry.hf}: {arr.shape} holds fewer than {h} heads")
        arr = flat[:h]  # K3 pads A_log to head_dim with zeros; only the first H are heads
    if tuple(arr.shape) != tuple(target_shape):
        raise CheckpointMismatch(f"{entry.hf}: shape {tuple(arr.shape)} after '{t}' does not match the "
                                 f"model's {tuple(target_shape)} at {'/'.join(entry.path)}")
    return arr


def from_tree_layout(entry: TensorEntry, arr: np.ndarray, stored: tuple[int, ...]) -> np.ndarray:
    """Inverse of `to_tree_layout`: a tree slice → the checkpoint array of shape `stored`."""
    t = entry.transform
    if t in ("T", "expertT", "conv"):
        arr = arr.T
    if t == "a_log":  # zero padding back, as the released K3 files store it
        flat = np.zeros(int(np.prod(stored)), arr.dtype)
        flat[:arr.shape[0]] = arr
        arr = flat
    return np.ascontiguousarray(arr.reshape(stored))


def read_entry(ckpt, entry: TensorEntry, names: set[str]) -> np.ndarray:
    """The checkpoint array of one entry, MXFP4 experts dequantized to fp32."""
    if not entry.is_expert:
        return ckpt.get(entry.hf)
    if f"{entry.hf}.weight" in names:
        return ckpt.get(f"{entry.hf}.weight")
    return dequantize_mxfp4_np(ckpt.get(f"{entry.hf}.weight_packed"), ckpt.get(f"{entry.hf}.weight_scale"))


def mxfp4_paths(entry: TensorEntry) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """Tree paths of an expert entry's two leaves under `expert_format='mxfp4'`."""
    return entry.path + ("weight_packed",), entry.path + ("weight_scale",)


def read_mxfp4_entry(ckpt, entry: TensorEntry, names: set[str]) -> tuple[np.ndarray, np.ndarray]:
    """(packed [out, in/2], scale [out, in/32]) uint8 of one expert, as stored; widened
    (.weight) experts are quantized by compressed-tensors' rule."""
    if f"{entry.hf}.weight" in names:
        return quantize_mxfp4(ckpt.get(f"{entry.hf}.weight"))
    return ckpt.get(f"{entry.hf}.weight_packed"), ckpt.get(f"{entry.hf}.weight_scale")


def check_names(cfg: ModelConfig, names, layout: str | None = None, *, check_vision: bool = False,
                vision: VisionConfig | None = None) -> dict:
    """Match checkpoint names against the map without reading data.

    Returns {'layout', 'dense_mlp_name', 'missing', 'unexpected', 'matched', 'entries',
    'vision', 'mxfp4'}. Vision/projector names are ignored unless `check_vision`; then
    they must be exactly the set `vision` implies, or absent altogether (text-only files).
    """
    names = set(names)
    layout = layout or detect_layout(names)
    dense_name = detect_dense_mlp_name(names, layout, cfg)
    entries = tensor_map(cfg, layout, dense_name)
    expected, missing = set(), []
    for e in entries:
        if e.is_expert:
            if f"{e.hf}.weight" in names:
                expected.add(f"{e.hf}.weight")
            elif f"{e.hf}.weight_packed" in names and f"{e.hf}.weight_scale" in names:
                expected.update((f"{e.hf}.weight_packed", f"{e.hf}.weight_scale"))
            else:
                missing.append(f"{e.hf}.weight")
        elif e.hf in names:
            expected.add(e.hf)
        else:
            missing.append(e.hf)
    unexpected = sorted(n for n in names - expected if not n.startswith(NON_TEXT_PREFIXES))
    vision_found: list[str] = []
    if check_vision:
        present = {n for n in names if n.startswith(NON_TEXT_PREFIXES)}
        implied = set(vision_names(vision)) if present else set()
        vision_found = sorted(present & implied)
        missing += sorted(implied - present)
        unexpected += sorted(present - implied)
    mxfp4 = any(f"{e.hf}.weight_packed" in expected for e in entries if e.is_expert)
    return {"layout": layout, "dense_mlp_name": dense_name, "missing": missing,
            "unexpected": unexpected, "matched": len(expected), "entries": entries,
            "vision": vision_found, "mxfp4": mxfp4}


def mismatch_message(where, report: dict, limit: int = 20) -> str:
    lines = [f"missing: {n}" for n in report["missing"][:limit]]
    lines += [f"unexpected: {n}" for n in report["unexpected"][:limit]]
    return (f"{where}: {len(report['missing'])} missing and {len(report['unexpected'])} unexpected "
            f"tensors\n" + "\n".join(lines))


def check_stored(ckpt, entry: TensorEntry, names: set[str], slot_shape, cfg: ModelConfig, layout: str) -> str:
    """Header-only check of one entry's dtype and shape; returns its source dtype string
    ('MXFP4' for packed experts). Errors name the tensor and its file."""
    from k3jax.checkpoint.names import stored_shape

    want = stored_shape(entry, tuple(slot_shape), cfg, layout)
    if entry.is_expert and f"{entry.hf}.weight" not in names:
        out_dim, in_dim = want
        for suffix, shape in (("weight_packed", (out_dim, in_dim // 2)), ("weight_scale", (out_dim, in_dim // 32))):
            name = f"{entry.hf}.{suffix}"
            dt, sh = ckpt.info(name)
            if dt != "U8":
                raise CheckpointMismatch(f"{name} ({ckpt.shard_of(name)}): MXFP4 {suffix} must be U8, found {dt}")
            if tuple(sh) != shape:
                raise CheckpointMismatch(f"{name} ({ckpt.shard_of(name)}): shape {tuple(sh)}, expected {shape}")
        return "MXFP4"
    name = f"{entry.hf}.weight" if entry.is_expert else entry.hf
    dt, sh = ckpt.info(name)
    if dt not in FLOAT_DTYPES:
        raise CheckpointMismatch(f"{name} ({ckpt.shard_of(name)}): dtype {dt} is not a float type "
                                 f"(expected one of {', '.join(FLOAT_DTYPES)})")
    ok = tuple(sh) == tuple(want)
    if entry.transform == "a_log":  # any of [H], [1, 1, H, 1] or K3's zero-padded [>= H] reads back
        ok = len(sh) in (1, 4) and int(np.prod(sh)) >= slot_shape[0] and (len(sh) == 1 or sh[2] == int(np.prod(sh)))
    if not ok:
        raise CheckpointMismatch(f"{name} ({ckpt.shard_of(name)}): shape {tuple(sh)} does not match the "
                                 f"config's {tuple(want)}")
    return dt


def load_hf_params(cfg: ModelConfig, hf_dir, dtype=None) -> dict:
    """All text params as a nested dict of numpy arrays shaped like `init_params`.

    dtype: cast every leaf (e.g. np.float32 for parity runs); default keeps each leaf in
    the model's param dtype (fp32 for the fp32-only params).
    """
    import jax

    from k3jax.model import param_shapes

    shapes = param_shapes(cfg)
    ckpt = ShardedCheckpoint(hf_dir)
    names = set(ckpt.keys())
    report = check_names(cfg, names)
    if report["missing"] or report["unexpected"]:
        raise CheckpointMismatch(mismatch_message(hf_dir, report))

    flat = {tuple(k.key for k in path): leaf for path, leaf in jax.tree_util.tree_leaves_with_path(shapes)}
    # integer leaves (MXFP4 bytes) keep their dtype whatever `dtype` asks of the floats
    out = {path: np.zeros(s.shape, s.dtype if not np.issubdtype(s.dtype, np.floating) else dtype or s.dtype)
           for path, s in flat.items()}
    filled: dict = {}
    for e in report["entries"]:
        if e.is_expert and e.path + ("weight_packed",) in out:
            for path, arr in zip(mxfp4_paths(e), read_mxfp4_entry(ckpt, e, names)):
                leaf = out[path]
                if tuple(arr.shape) != leaf.shape[len(e.index):]:
                    raise CheckpointMismatch(f"{e.hf}: MXFP4 {path[-1]} of shape {tuple(arr.shape)} does not match "
                                             f"the model's {leaf.shape[len(e.index):]} at {'/'.join(path)}")
                leaf[e.index] = arr
                filled.setdefault(path, set()).add(e.index)
            continue
        if e.path not in out:
            raise CheckpointMismatch(f"{e.hf}: the model has no param {'/'.join(e.path)}")
        leaf = out[e.path]
        slot_shape = leaf.shape[len(e.index):]
        leaf[e.index] = to_tree_layout(e, read_entry(ckpt, e, names), slot_shape).astype(leaf.dtype)
        filled.setdefault(e.path, set()).add(e.index)
    ckpt.close()
    for path, leaf in out.items():  # a param no checkpoint tensor fills would stay silently zero
        n_idx = len(next(iter(filled.get(path, {()}))))
        if len(filled.get(path, ())) != int(np.prod(leaf.shape[:n_idx])):
            raise CheckpointMismatch(f"param {'/'.join(path)} is not fully covered by the checkpoint map")
    return unflatten(out)


def unflatten(flat: dict) -> dict:
    """{(key, ..., leaf): array} -> the nested dict param tree."""
    tree: dict = {}
    for path, arr in flat.items():
        node = tree
        for k in path[:-1]:
            node = node.setdefault(k, {})
        node[path[-1]] = arr
    return tree
