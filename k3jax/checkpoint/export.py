"""k3jax checkpoint or training run → the released safetensors layout (vLLM / SGLang / transformers).

The source is a `k3jax convert` output, a training run directory (its newest checkpoint)
or one of its `checkpoints/N` (`k3jax.checkpoint.load.resolve`); from a run only the
params are read. Names and shapes come from the same `names.tensor_map` the converter uses. Dtypes follow
the released checkpoint (`names.release_dtype`: bf16, except KDA A_log, dt_bias, conv
weights, o_norm and the router bias in fp32); `A_log` is zero-padded back to head_dim in
the K3 layout. Every tensor is written in its release dtype whatever the run trained in,
with one exception for runs: the params the model keeps in fp32 even with bf16 params
(norms, AttnRes vectors) stay fp32 when the run holds them so, since rounding them would
change the run's logits (~1e-2 on the toy model) and a serving stack casts them on load
anyway. The result's `casts` counts each (stored dtype → written dtype) change, so a run
trained with fp32 params says how many matrices were rounded to bf16, and `kept_fp32`
counts the exceptions. Routed experts are re-packed to MXFP4 unless `experts_bf16`.

Byte-identical MXFP4: a group whose codes are all ±0 keeps no trace of its scale byte in
the values, so re-deriving scales cannot reproduce every stored tensor. The converter
keeps the original scale bytes (`mxfp4_scales/`); an expert is re-packed with them when
that reproduces its current values exactly (it was not changed since conversion), and
freshly quantized (compressed-tensors' rule, `quantize_mxfp4`) otherwise (always, for a run).

Vision: the `vision/` tree goes back under its `vision_tower.*` / `mm_projector.*` names
(`k3jax.vision.vision_names`), each tensor in the dtype it was converted from (the
manifest's `vision_dtypes`), so an unchanged tower round-trips byte for byte.

Streaming: tensors are produced in checkpoint order, one at a time, from slices of the
stored leaves (only their chunks are read) and flushed into a shard file whenever the
shard reaches `max_shard_bytes`; the output is assembled in a temporary directory and
renamed when complete, like `convert`.
"""
from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import numpy as np

from k3jax.checkpoint.hf_params import from_tree_layout
from k3jax.checkpoint.dirs import remove_stale_temps, temp_sibling
from k3jax.checkpoint.load import local_path, resolve
from k3jax.checkpoint.mxfp4 import dequantize_mxfp4_np, quantize_mxfp4, requantize_with_scale
from k3jax.checkpoint.names import release_dtype, stored_shape, tensor_map
from k3jax.checkpoint.orbax_io import open_leaf, stored_leaves
from k3jax.checkpoint.safetensors_io import DTYPES, INDEX_NAME, write_safetensors
from k3jax.config import K3Config
from k3jax.errors import K3JaxError

DEFAULT_SHARD_BYTES = 5 * 10**9


class _Leaves:
    """Slices of one Orbax item's leaves (those under `prefix`), each leaf opened once."""

    def __init__(self, item_dir: Path, prefix: tuple = ()):
        self.item_dir, self.prefix = item_dir, tuple(prefix)
        n = len(self.prefix)
        self.paths = {p[n:] for p in stored_leaves(item_dir) if p[:n] == self.prefix}
        self._open: dict = {}

    def get(self, path, index) -> np.ndarray:
        if path not in self.paths:
            raise K3JaxError(f"{self.item_dir}: no leaf {'.'.join(self.prefix + tuple(path))}")
        leaf = self._open.get(path)
        if leaf is None:
            leaf = self._open[path] = open_leaf(self.item_dir, self.prefix + tuple(path))
        return np.asarray((leaf[tuple(index)] if index else leaf).read().result())


class _ShardWriter:
    """Accumulates tensors and writes `model-{i:05d}-of-{n:05d}.safetensors` shards."""

    def __init__(self, directory: Path, max_bytes: int):
        self.directory, self.max_bytes = directory, max_bytes
        self.pending: dict[str, np.ndarray] = {}
        self.pending_bytes = 0
        self.files: list[tuple[str, list[str]]] = []
        self.total = 0

    def add(self, name: str, arr: np.ndarray) -> None:
        if self.pending and self.pending_bytes + arr.nbytes > self.max_bytes:
            self.flush()
        self.pending[name] = arr
        self.pending_bytes += arr.nbytes
        self.total += arr.nbytes

    def flush(self) -> None:
        if not self.pending:
            return
        tmp_name = f"shard-{len(self.files):05d}.safetensors"
        write_safetensors(self.directory / tmp_name, self.pending, metadata={"format": "pt"})
        self.files.append((tmp_name, list(self.pending)))
        self.pending, self.pending_bytes = {}, 0

    def finish(self) -> None:
        self.flush()
        n = len(self.files)
        weight_map = {}
        for i, (tmp_name, names) in enumerate(self.files):
            final = f"model-{i + 1:05d}-of-{n:05d}.safetensors"
            os.rename(self.directory / tmp_name, self.directory / final)
            weight_map.update({name: final for name in names})
        index = {"metadata": {"total_size": self.total}, "weight_map": dict(sorted(weight_map.items()))}
        (self.directory / INDEX_NAME).write_text(json.dumps(index, indent=2) + "\n")


def _cast(arr: np.ndarray, dtype_str: str, casts: dict | None = None) -> np.ndarray:
    """`arr` in the safetensors dtype `dtype_str`; a change of dtype is counted in `casts`."""
    want = DTYPES[dtype_str]
    if casts is not None and arr.dtype != want:
        key = f"{arr.dtype.name} -> {dtype_str}"
        casts[key] = casts.get(key, 0) + 1
    return np.ascontiguousarray(arr.astype(want))


def _pack_expert(w: np.ndarray, scale: np.ndarray | None):
    """MXFP4 bytes of an expert [out, in]: original scales when they reproduce w exactly."""
    if scale is not None and scale.max(initial=0) < 255:
        packed = requantize_with_scale(w, scale)
        if np.array_equal(dequantize_mxfp4_np(packed, scale), w.astype(np.float32)):
            return packed, scale
    return quantize_mxfp4(w)


def _add_vision(out: _ShardWriter, k3: K3Config, leaves: _Leaves, dtypes: dict[str, str], casts: dict) -> None:
    """The vision tree back under its checkpoint names, in the dtype each tensor was
    converted from (bf16, the released dtype, when the manifest does not say)."""
    from k3jax.vision.vision_names import to_hf, vision_tensor_map

    if k3.vision is None:
        raise K3JaxError("the checkpoint holds vision params but its config.json has no vision_config")
    for e in vision_tensor_map(k3.vision):
        out.add(e.hf, _cast(to_hf(e, leaves.get(e.path, e.index)), dtypes.get(e.hf, "BF16"), casts))


def export(ckpt_dir, hf_dir, *, experts_bf16: bool = False, max_shard_bytes: int = DEFAULT_SHARD_BYTES,
           progress: bool = False, log=None) -> dict:
    """Write HF_DIR from a `k3jax convert` output, a training run or one of its
    checkpoints/N. Returns the index's total_size, shard and tensor counts, the source
    (`ModelSource.describe()`) and `casts` {'float32 -> BF16': n, ...}: every tensor whose
    stored dtype differs from the one written (MXFP4 packing is not counted), and
    `kept_fp32`, the count of a run's fp32-kept params written as fp32 (module docstring)."""
    hf_dir = local_path(hf_dir, "output")
    src = resolve(ckpt_dir)
    if src.kind == "hf":
        raise K3JaxError(f"{src.path}: already an HF safetensors checkpoint; export reads a `k3jax convert` "
                         "output or a training run")
    if hf_dir.exists():
        raise FileExistsError(f"{hf_dir} already exists; refusing to overwrite it")
    # a conversion's config.json as it came (key order, extras); a run's from its config.yaml
    hf_config = json.loads((src.path / "config.json").read_text()) if src.kind == "orbax" else src.k3.to_hf()
    k3 = src.k3
    cfg, layout = k3.text, src.layout
    if not experts_bf16 and cfg.num_experts and not _has_quantization_config(hf_config):
        raise K3JaxError(f"{src.describe()}: its config.json has no quantization_config describing MXFP4 "
                         "experts (a config without MXFP4 experts); export with --experts-bf16")

    if src.kind == "orbax" and (src.path / "extra").exists():
        # the first conversions kept vision tensors verbatim there; exporting without them
        # would silently drop the vision tower
        raise K3JaxError(f"{src.path}: vision tensors in extra/ come from an older `k3jax convert`; "
                         "convert the HF directory again")
    params = _Leaves(src.item_dir, src.prefix)
    scales_dir = src.path / "mxfp4_scales" if src.kind == "orbax" else None
    scales = _Leaves(scales_dir) if scales_dir is not None and scales_dir.exists() else None
    entries = tensor_map(cfg, layout, src.dense_mlp_name)
    casts: dict[str, int] = {}
    keep_fp32 = _model_fp32_paths(cfg) if src.kind == "run" else set()
    kept = 0

    from tqdm import tqdm
    remove_stale_temps(hf_dir, log)
    tmp = temp_sibling(hf_dir)
    hf_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp.mkdir()
    try:
        out = _ShardWriter(tmp, max_shard_bytes)
        bar = tqdm(total=len(entries), unit="tensor", desc=f"export {hf_dir.name}", disable=not progress)
        for e in entries:
            slot = params.get(e.path, e.index)
            if not e.is_expert:
                shape = stored_shape(e, slot.shape, cfg, layout)
                dtype = release_dtype(e.hf)
                if dtype != "F32" and e.path in keep_fp32 and slot.dtype == np.float32:
                    dtype, kept = "F32", kept + 1
                out.add(e.hf, _cast(from_tree_layout(e, slot, shape), dtype, casts))
            else:
                w = np.ascontiguousarray(slot.T)  # [in, out] -> [out, in]
                if experts_bf16:
                    out.add(f"{e.hf}.weight", _cast(w, "BF16", casts))
                else:
                    scale = scales.get(e.path, e.index) if scales is not None and e.path in scales.paths else None
                    packed, scale = _pack_expert(w, scale)
                    out.add(f"{e.hf}.weight_packed", packed)
                    out.add(f"{e.hf}.weight_scale", scale)
            bar.update(1)
        if src.kind == "orbax" and (src.path / "vision").exists():
            _add_vision(out, k3, _Leaves(src.path / "vision"), src.manifest.get("vision_dtypes") or {}, casts)
        bar.close()
        out.finish()
        if src.kind == "orbax" and not experts_bf16:
            shutil.copyfile(src.path / "config.json", tmp / "config.json")   # byte for byte
        else:
            if experts_bf16:  # the packed-weight quantization block no longer describes the files
                hf_config.get("text_config", hf_config).pop("quantization_config", None)
            (tmp / "config.json").write_text(json.dumps(hf_config, indent=2) + "\n")
        os.rename(tmp, hf_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return {"total_size": out.total, "shards": len(out.files), "tensors": sum(len(n) for _, n in out.files),
            "source": src.describe(), "casts": casts, "kept_fp32": kept}


def _model_fp32_paths(cfg) -> set:
    """Param paths the model keeps in fp32 even when its params are bf16."""
    import jax
    from flax import linen as nn

    from k3jax.model import abstract_params
    tree = nn.unbox(abstract_params(cfg.with_runtime(param_dtype="bfloat16")))
    return {tuple(k.key for k in p) for p, leaf in jax.tree_util.tree_leaves_with_path(tree)
            if leaf.dtype == np.float32}


def _has_quantization_config(hf_config: dict) -> bool:
    return bool(hf_config.get("text_config", hf_config).get("quantization_config")
                or hf_config.get("quantization_config"))
