"""The name map between the checkpoint's `vision_tower.*` / `mm_projector.*` tensors and
k3jax's vision param tree (`k3jax.layers.vision.KimiVision`), both ways.

As in `k3jax.checkpoint.names` for the text model: one entry per checkpoint tensor says where
it lands (tree path + index along the stacked `layers` axis) and how it is transformed, and
both `load_vision_params` and `vision_params_to_hf` go through `vision_tensor_map`, so the
two directions cannot drift apart.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from k3jax.config import VisionConfig
from k3jax.errors import K3JaxError

# transforms (checkpoint -> tree):
#   copy   same array
#   T      [out, in] -> [in, out]
#   patch  Conv2d weight [D, C, P, P] -> [C·P·P, D] (the patch embedding as a matmul on the
#          flattened channel-major patch)
TRANSFORMS = ("copy", "T", "patch")
PREFIXES = ("vision_tower.", "mm_projector.")


class VisionCheckpointError(K3JaxError):
    """A vision tensor is missing, unexpected or mis-shaped; the message names it."""


@dataclass(frozen=True)
class VisionTensorEntry:
    hf: str                      # checkpoint name
    path: tuple[str, ...]        # param tree path
    index: tuple[int, ...]       # index along the leaf's stacked leading axes ((layer,) for blocks)
    transform: str


def vision_tensor_map(vcfg: VisionConfig) -> list[VisionTensorEntry]:
    """Every vision checkpoint tensor, in the checkpoint's module order."""
    vt, E = ("vision_tower",), VisionTensorEntry
    out = [E("vision_tower.patch_embed.proj.weight", vt + ("patch_embed", "proj", "kernel"), (), "patch"),
           E("vision_tower.patch_embed.pos_emb.weight", vt + ("patch_embed", "pos_emb"), (), "copy")]
    blocks = vt + ("blocks",)
    for i in range(vcfg.vt_num_hidden_layers):
        hp = f"vision_tower.encoder.blocks.{i}."
        out += [E(hp + "norm0.weight", blocks + ("norm0", "weight"), (i,), "copy"),
                E(hp + "norm1.weight", blocks + ("norm1", "weight"), (i,), "copy"),
                E(hp + "wqkv.weight", blocks + ("wqkv", "kernel"), (i,), "T"),
                E(hp + "wo.weight", blocks + ("wo", "kernel"), (i,), "T"),
                E(hp + "mlp.fc0.weight", blocks + ("mlp", "fc0", "kernel"), (i,), "T"),
                E(hp + "mlp.fc1.weight", blocks + ("mlp", "fc1", "kernel"), (i,), "T")]
    out += [E("vision_tower.encoder.final_layernorm.weight", vt + ("final_layernorm", "weight"), (), "copy"),
            E("mm_projector.proj.0.weight", ("mm_projector", "proj_0", "kernel"), (), "T"),
            E("mm_projector.proj.2.weight", ("mm_projector", "proj_2", "kernel"), (), "T"),
            E("mm_projector.post_norm.weight", ("mm_projector", "post_norm", "weight"), (), "copy")]
    return out


def stored_shape(entry: VisionTensorEntry, slot_shape: tuple[int, ...]) -> tuple[int, ...]:
    """Checkpoint shape of an entry whose tree slot (one layer's slice) has `slot_shape`."""
    if entry.transform == "T":
        return tuple(reversed(slot_shape))
    if entry.transform == "patch":
        (cpp, d) = slot_shape
        p = int(round((cpp // 3) ** 0.5))
        return (d, 3, p, p)
    return tuple(slot_shape)


def to_tree(entry: VisionTensorEntry, arr: np.ndarray) -> np.ndarray:
    if entry.transform == "T":
        return arr.T
    if entry.transform == "patch":
        return arr.reshape(arr.shape[0], -1).T  # (c, y, x) flattening matches the pixel layout
    return arr


def to_hf(entry: VisionTensorEntry, arr: np.ndarray) -> np.ndarray:
    if entry.transform == "T":
        return arr.T
    if entry.transform == "patch":
        d = arr.shape[1]
        p = int(round((arr.shape[0] // 3) ** 0.5))
        return arr.T.reshape(d, 3, p, p)
    return arr


def _get(tree, path):
    for k in path:
        tree = tree[k]
    return tree


def check_vision_names(vcfg: VisionConfig, names) -> dict[str, list[str]]:
    """{'missing': [...], 'unexpected': [...]} among a checkpoint's vision tensor names."""
    want = {e.hf for e in vision_tensor_map(vcfg)}
    have = {n for n in names if n.startswith(PREFIXES)}
    return {"missing": sorted(want - have), "unexpected": sorted(have - want)}


def load_vision_params(vcfg: VisionConfig, ckpt, dtype=np.float32) -> dict:
    """The vision param tree (numpy, `dtype`) from a checkpoint: an HF directory or any object
    with `keys()`, `info(name) -> (dtype, shape)` and `get(name)` (e.g. ShardedCheckpoint).

    Any missing, unexpected or mis-shaped vision tensor raises, naming it.
    """
    from k3jax.layers.vision import vision_param_shapes
    if not hasattr(ckpt, "get"):
        from k3jax.checkpoint.safetensors_io import ShardedCheckpoint
        ckpt = ShardedCheckpoint(ckpt)
    problems = check_vision_names(vcfg, ckpt.keys())
    if problems["missing"] or problems["unexpected"]:
        raise VisionCheckpointError(
            f"vision tensors do not match the config: missing {problems['missing'][:5]}"
            f"{' …' if len(problems['missing']) > 5 else ''} ({len(problems['missing'])}), unexpected "
            f"{problems['unexpected'][:5]} ({len(problems['unexpected'])})")
    shapes = vision_param_shapes(vcfg)
    tree = _zeros_like_shapes(shapes, dtype)
    for e in vision_tensor_map(vcfg):
        slot = _get(tree, e.path)
        slot_shape = slot.shape[len(e.index):]
        want = stored_shape(e, slot_shape)
        _, got = ckpt.info(e.hf)
        if tuple(got) != want:
            raise VisionCheckpointError(f"{e.hf}: shape {tuple(got)}, expected {want} from the vision config")
        slot[e.index] = to_tree(e, np.asarray(ckpt.get(e.hf))).astype(dtype)
    return tree


def vision_params_to_hf(vcfg: VisionConfig, params: dict, dtype=None) -> dict[str, np.ndarray]:
    """The checkpoint tensors {name: array} of a vision param tree (the inverse of loading)."""
    out = {}
    for e in vision_tensor_map(vcfg):
        arr = np.asarray(_get(params, e.path))[e.index]
        arr = np.ascontiguousarray(to_hf(e, arr))
        out[e.hf] = arr if dtype is None else arr.astype(dtype)
    return out


def _zeros_like_shapes(shapes, dtype):
    if isinstance(shapes, dict):
        return {k: _zeros_like_shapes(v, dtype) for k, v in shapes.items()}
    return np.zeros(shapes.shape, dtype)
