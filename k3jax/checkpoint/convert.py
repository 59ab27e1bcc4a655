"""Hugging Face safetensors directory → k3jax Orbax checkpoint, streamed tensor by tensor.

The output directory:

    config.json            the source config, byte for byte (rebuilds the model)
    params/                Orbax pytree of the text params, in the tree `K3Model` uses
    mxfp4_scales/          (MXFP4 sources) Orbax pytree of the original E8M0 scale bytes,
                           [..., expert, out, in/32] at the same paths as the expert stacks,
                           so `export` can re-pack unchanged experts byte for byte
    vision/                (if the files hold the vision tower) Orbax pytree of the vision
                           params {'vision_tower', 'mm_projector'} in the tree
                           `k3jax.layers.vision.KimiVision` uses, blocks stacked on `layers`
    k3jax_checkpoint.json  manifest, written last

Memory: every checkpoint tensor is read through the memory map, transformed and written
into its slice of the stacked leaf on disk (orbax_io.TreeWriter) before the next one is
read; the shard mappings are dropped after each decoder layer so their resident pages do
not accumulate. Peak host memory is a few copies of the largest single tensor (an expert
is handled one at a time), independent of depth and expert count.

Atomicity: everything is written into a hidden temporary sibling of OUT_DIR and renamed
onto OUT_DIR only when complete; on an error the temporary directory is removed, and what
a killed convert left (its pid gone) is removed by the next convert of OUT_DIR on that
host (`dirs.remove_stale_temps`). A directory without `k3jax_checkpoint.json` is never a
finished conversion.
"""
from __future__ import annotations

import dataclasses
import json
import os
import re
import shutil
from pathlib import Path

import numpy as np

from k3jax.checkpoint.hf_params import (FLOAT_DTYPES, CheckpointMismatch, check_names, check_stored,
                                        mismatch_message, mxfp4_paths, read_mxfp4_entry, to_tree_layout)
from k3jax.checkpoint.dirs import FORMAT, MANIFEST, local_path, remove_stale_temps, temp_sibling
from k3jax.checkpoint.mxfp4 import dequantize_mxfp4_np
from k3jax.checkpoint.orbax_io import TreeWriter
from k3jax.checkpoint.safetensors_io import DTYPES, ShardedCheckpoint
from k3jax.config import K3Config

_LAYER = re.compile(r"\.layers\.(\d+)\.")


def _load_config(hf_dir: Path) -> K3Config:
    path = hf_dir / "config.json"
    if not path.is_file():
        raise FileNotFoundError(f"{hf_dir}: no config.json")
    return K3Config.from_hf(path)


def dry_run(hf_dir) -> dict:
    """Match every name in the index (or the single file's header) against the map; no
    tensor data is read. The report's 'missing' / 'unexpected' lists are complete."""
    hf_dir = Path(hf_dir)
    k3 = _load_config(hf_dir)
    ckpt = ShardedCheckpoint(hf_dir)
    try:
        names = ckpt.keys()
    finally:
        ckpt.close()
    report = check_names(k3.text, names, k3.layout, check_vision=True, vision=k3.vision)
    report.pop("entries")
    report["total"] = len(names)
    report["experts_mxfp4"] = sum(n.endswith(".weight_packed") for n in names)
    report["index"] = str(ckpt.index_path or hf_dir / "model.safetensors")
    return report


def _leaf_dtype(source_dtypes: set[str]) -> np.dtype:
    # Keep what the source holds exactly: MXFP4 values are exact in bf16; mixing widths
    # (or any fp32 source) keeps fp32; MXFP4 bytes kept packed stay uint8.
    if source_dtypes == {"U8"}:
        return np.dtype(np.uint8)
    kinds = {"BF16" if d == "MXFP4" else d for d in source_dtypes}
    return DTYPES[kinds.pop()] if len(kinds) == 1 and kinds <= {"BF16", "F16", "F32"} else DTYPES["F32"]


def _plan(k3: K3Config, ckpt: ShardedCheckpoint):
    """Validate names, dtypes and shapes from the headers alone, before anything is written."""
    import jax

    from k3jax.model import param_shapes

    cfg = k3.text
    names = set(ckpt.keys())
    report = check_names(cfg, names, k3.layout, check_vision=True, vision=k3.vision)
    if report["missing"] or report["unexpected"]:
        raise CheckpointMismatch(mismatch_message(ckpt.directory, report))
    abstract = param_shapes(cfg)
    shapes = {tuple(k.key for k in p): tuple(leaf.shape) for p, leaf in jax.tree_util.tree_leaves_with_path(abstract)}
    sources: dict[tuple, set] = {}
    n_lead: dict[tuple, int] = {}
    slots: dict[tuple, set] = {}
    for e in report["entries"]:
        if e.is_expert and e.path + ("weight_packed",) in shapes:   # kept as MXFP4 bytes
            packed, scale = mxfp4_paths(e)
            out_dim, half = shapes[packed][len(e.index):]
            check_stored(ckpt, e, names, (2 * half, out_dim), cfg, k3.layout)
            for p in (packed, scale):
                sources.setdefault(p, set()).add("U8")
                n_lead[p] = len(e.index)
                slots.setdefault(p, set()).add(e.index)
            continue
        if e.path not in shapes:
            raise CheckpointMismatch(f"{e.hf}: the model has no param {'/'.join(e.path)}")
        slot = shapes[e.path][len(e.index):]
        sources.setdefault(e.path, set()).add(check_stored(ckpt, e, names, slot, cfg, k3.layout))
        n_lead[e.path] = len(e.index)
        slots.setdefault(e.path, set()).add(e.index)
    # a slot no tensor fills would be left as zeros on disk without complaint
    uncovered = sorted(p for p in shapes if len(slots.get(p, ())) != int(np.prod(shapes[p][:n_lead.get(p, 0)])))
    if uncovered:
        raise CheckpointMismatch(f"params {['/'.join(p) for p in uncovered[:10]]} are not filled by any tensor")
    leaves = {p: (shapes[p], _leaf_dtype(sources[p]), n_lead[p]) for p in shapes}
    return report, leaves, (_plan_vision(k3, ckpt) if report["vision"] else None)


def _plan_vision(k3: K3Config, ckpt: ShardedCheckpoint):
    """({path: (shape, dtype, n_lead)}, {name: source dtype}) of the vision tree, from headers.

    The source dtypes go into the manifest so `export` writes every tensor back as it came."""
    import jax

    from k3jax.layers.vision import vision_param_shapes
    from k3jax.checkpoint.vision_names import stored_shape, vision_tensor_map

    shapes = {tuple(k.key for k in p): tuple(leaf.shape)
              for p, leaf in jax.tree_util.tree_leaves_with_path(vision_param_shapes(k3.vision))}
    sources: dict[tuple, set] = {}
    n_lead: dict[tuple, int] = {}
    dtypes = {}
    for e in vision_tensor_map(k3.vision):
        dt, sh = ckpt.info(e.hf)
        want = stored_shape(e, shapes[e.path][len(e.index):])
        if dt not in FLOAT_DTYPES:
            raise CheckpointMismatch(f"{e.hf} ({ckpt.shard_of(e.hf)}): dtype {dt} is not a float type")
        if tuple(sh) != want:
            raise CheckpointMismatch(f"{e.hf} ({ckpt.shard_of(e.hf)}): shape {tuple(sh)} does not match the "
                                     f"vision config's {want}")
        sources.setdefault(e.path, set()).add(dt)
        n_lead[e.path] = len(e.index)
        dtypes[e.hf] = dt
    return {p: (shapes[p], _leaf_dtype(sources[p]), n_lead[p]) for p in shapes}, dtypes


def _source_bytes(ckpt: ShardedCheckpoint, names) -> int:
    total = 0
    for n in names:
        dt, shape = ckpt.info(n)
        total += int(np.prod(shape)) * DTYPES[dt].itemsize
    return total


def _progress(total: int, enabled: bool, desc: str):
    from tqdm import tqdm
    return tqdm(total=total, unit="B", unit_scale=True, unit_divisor=1024, desc=desc, disable=not enabled,
                dynamic_ncols=True, smoothing=0.1)


def _units(entries):
    """Entries grouped per decoder layer (in order), the non-layer tensors first."""
    units: dict[int, list] = {}
    for e in entries:
        m = _LAYER.search(e.hf)
        units.setdefault(int(m.group(1)) if m else -1, []).append(e)
    return [units[k] for k in sorted(units)]


def convert(hf_dir, out_dir, *, progress: bool = False, log=None, expert_format: str = "bf16") -> dict:
    """Convert; returns the manifest. Raises before writing anything if names, dtypes or
    shapes do not match the config; refuses to overwrite an existing OUT_DIR.

    `expert_format='mxfp4'` keeps the routed experts packed (the source's own bytes, or
    widened experts quantized), as `load_model_dir(..., expert_format='mxfp4')` holds them."""
    hf_dir, out_dir = local_path(hf_dir, "HF checkpoint"), local_path(out_dir, "output")
    if out_dir.exists():
        raise FileExistsError(f"{out_dir} already exists; refusing to overwrite it")
    k3 = _load_config(hf_dir)
    k3 = dataclasses.replace(k3, text=k3.text.with_runtime(expert_format=expert_format))
    ckpt = ShardedCheckpoint(hf_dir)
    report, leaves, vision = _plan(k3, ckpt)
    names = set(ckpt.keys())
    mxfp4 = report["mxfp4"]
    total = _source_bytes(ckpt, names)

    remove_stale_temps(out_dir, log)
    tmp = temp_sibling(out_dir)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp.mkdir()
    try:
        params = TreeWriter(tmp / "params", leaves)
        scales = None
        if mxfp4 and expert_format == "bf16":
            expert_paths = {e.path: len(e.index) for e in report["entries"] if e.is_expert}
            scales = TreeWriter(tmp / "mxfp4_scales", {
                p: (leaves[p][0][:n] + (leaves[p][0][-1], leaves[p][0][-2] // 32), np.uint8, n)
                for p, n in expert_paths.items()})
        bar = _progress(total, progress, f"convert {hf_dir.name}")
        for unit in _units(report["entries"]):
            for e in unit:
                bar.update(_write_entry(ckpt, e, names, params, scales, leaves))
            ckpt.close()  # unmap this layer's shards: resident pages would otherwise pile up
        if vision is not None:
            bar.update(_write_vision(ckpt, k3, tmp / "vision", vision[0]))
        ckpt.close()
        params.finalize()
        if scales is not None:
            scales.finalize()
        bar.close()
        shutil.copyfile(hf_dir / "config.json", tmp / "config.json")
        manifest = {"format": FORMAT, "layout": report["layout"], "dense_mlp_name": report["dense_mlp_name"],
                    "experts": "mxfp4" if mxfp4 else "float", "expert_format": expert_format,
                    "vision_tensors": len(report["vision"]),
                    "vision_dtypes": vision[1] if vision is not None else {},
                    "tensors": len(names), "source_bytes": total, "source": str(hf_dir)}
        (tmp / MANIFEST).write_text(json.dumps(manifest, indent=1) + "\n")
        os.rename(tmp, out_dir)
    except BaseException:
        ckpt.close()
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return manifest


def _write_vision(ckpt, k3: K3Config, directory: Path, leaves) -> int:
    """The vision tree, tensor by tensor (a block's weights into its layer slice); source bytes."""
    from k3jax.checkpoint.vision_names import to_tree, vision_tensor_map

    writer, total = TreeWriter(directory, leaves), 0
    for e in vision_tensor_map(k3.vision):
        arr = ckpt.get(e.hf)
        writer.write(e.path, e.index, np.ascontiguousarray(to_tree(e, arr)).astype(leaves[e.path][1]))
        total += arr.nbytes
    writer.finalize()
    return total


def _write_entry(ckpt, e, names, params: TreeWriter, scales: TreeWriter | None, leaves) -> int:
    """Read, transform and write one entry; returns the source bytes it consumed."""
    if e.is_expert and e.path + ("weight_packed",) in leaves:
        total = 0
        for path, arr in zip(mxfp4_paths(e), read_mxfp4_entry(ckpt, e, names)):
            params.write(path, e.index, arr)
            total += arr.nbytes
        return total
    shape, dtype, _ = leaves[e.path]
    slot = shape[len(e.index):]
    if e.is_expert and f"{e.hf}.weight" not in names:
        packed, scale = ckpt.get(f"{e.hf}.weight_packed"), ckpt.get(f"{e.hf}.weight_scale")
        w = dequantize_mxfp4_np(packed, scale)
        params.write(e.path, e.index, to_tree_layout(e, w, slot).astype(dtype))
        scales.write(e.path, e.index, scale)
        return packed.nbytes + scale.nbytes
    name = f"{e.hf}.weight" if e.is_expert else e.hf
    arr = ckpt.get(name)
    params.write(e.path, e.index, to_tree_layout(e, arr, slot).astype(dtype))
    return arr.nbytes
