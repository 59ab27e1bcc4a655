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
(`k3jax.checkpoint.vision_names`), each tensor in the dtype it was converted from (the
manifest's `vision_dtypes`), so an unchanged tower round-trips byte for byte.

MXFP4-resident experts (`convert --expert-format mxfp4`, runs with `runtime.expert_format:
mxfp4`) are stored as their bytes: an unchanged expert is written back as stored.

LoRA runs hold adapters and router biases only; their base is the run's `init_from` (or
its seed). `merge_lora=True` writes W + (alpha/r)·A·B for every adapted tensor (merged in
fp32 one rank at a time, as a QAT forward merges: `update_loss.merged_fp32`), routed
experts re-quantized to MXFP4 (compressed-tensors' rule) unless `experts_bf16`; the
result's `requant` says how far the stored bytes are from the merged values
(`adapters.RequantError`). For a merged LoRA run and a full fine-tune (its update measured
against its init_from or seed) the result's `lost` says what fraction of the fine-tune's
update the storage format lost from the weights the run's forward used
(`update_loss.UpdateLoss`): 0 for a QAT run (`qat: true`), whose forward used the stored
values themselves. Without it, a LoRA run is refused: export its adapters with
`export_adapter` (a PEFT directory), or merge them.

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
from k3jax.checkpoint.update_loss import UpdateLoss, merged_fp32
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


class _Tree:
    """`_Leaves`' interface over an in-memory param tree (a LoRA run's random-init base)."""

    def __init__(self, tree: dict):
        import jax
        self.flat = {tuple(k.key for k in p): x for p, x in jax.tree_util.tree_leaves_with_path(tree)}
        self.paths = set(self.flat)

    def get(self, path, index) -> np.ndarray:
        if path not in self.flat:
            raise K3JaxError(f"no param {'/'.join(path)}")
        x = self.flat[path]
        return np.asarray(x[tuple(index)] if index else x)


class _Source:
    """The tensors an export writes: a base's leaves (widened or MXFP4 experts) and, for a
    merged LoRA run, its adapters folded in on read. `init`: a full fine-tune's initial
    weights (a _Source), for the size of its update. `lost` (update_loss.UpdateLoss) is
    kept for a merged LoRA run and for a full fine-tune whose init is known."""

    def __init__(self, base, adapters=None, spec=None, cfg=None, *, qat: bool = False, init=None):
        self.base, self.adapters, self.spec, self.cfg, self.init = base, adapters, spec, cfg, init
        self.requant = self.lost = None
        if adapters is not None:
            from k3jax.checkpoint.adapters import RequantError
            self.requant = RequantError()
        if adapters is not None or init is not None:
            self.lost = UpdateLoss(qat)

    def _adapter(self, path):
        """(target, path of the adapter) when `path` (a tree leaf path) is adapted."""
        if self.adapters is None:
            return None
        from k3jax.layout import layer_subpath
        module = path[:-1] if path[-1] == "kernel" else path
        target = layer_subpath(module)
        if target not in self.spec.targets:
            return None
        return target, module

    def _operands(self, path, index, expert=None):
        """(A [in, r], B [r, out], alpha/r) of an adapted slot (one expert's when given)."""
        hit = self._adapter(path)
        if hit is None:
            return None
        target, module = hit
        a = self.adapters.get(module + ("lora_a",), index)
        b = self.adapters.get(module + ("lora_b",), index)
        if expert is not None:
            a, b = (a if a.ndim == 2 else a[expert]), b[expert]
        return a, b, self.spec.scale_of(target)

    def dense(self, path, index):
        """(A non-expert tree slot, merged when adapted; its update or None): the merge in
        fp32 one rank at a time, as a QAT forward merges (update_loss.merged_fp32); a full
        fine-tune's update is the slot less its init."""
        slot = self.base.get(path, index)
        ops = self._operands(path, index)
        if ops is not None:
            a, b, s = ops
            return merged_fp32(slot, a, b, s)
        if self.init is not None and slot.dtype.kind == "f" and slot.ndim >= 2:   # weights, not norms or biases
            return slot, slot.astype(np.float64) - self.init.base.get(path, index).astype(np.float64)
        return slot, None

    def is_packed(self, e) -> bool:
        return e.path + ("weight_packed",) in self.base.paths

    def expert(self, e):
        """(w [out, in] float or None, packed, scale or None, update [out, in] or None): one
        expert, as stored (packed bytes when MXFP4-resident and unchanged) or merged (in fp32,
        as `dense`), with the adapters' or a full fine-tune's update."""
        idx, ex = e.index[:-1], e.index[-1]
        ops = self._operands(e.path, idx, ex)
        if self.is_packed(e):
            packed = self.base.get(e.path + ("weight_packed",), e.index)
            scale = self.base.get(e.path + ("weight_scale",), e.index)
            if ops is None:
                return None, packed, scale, None
            w = dequantize_mxfp4_np(packed, scale, np.float32)
        else:
            w = np.ascontiguousarray(self.base.get(e.path, e.index).T)  # [in, out] -> [out, in]
            if ops is None:
                if self.init is None:
                    return w, None, None, None
                w0 = self.init.expert(e)
                w0 = dequantize_mxfp4_np(w0[1], w0[2], np.float64) if w0[0] is None else w0[0]
                return w, None, None, w.astype(np.float64) - w0.astype(np.float64)
        a, b, s = ops                    # [out, in]: Bᵀ [out, r] times Aᵀ [r, in]
        merged, d = merged_fp32(w, np.asarray(b).T, np.asarray(a).T, s)
        return merged, None, None, d


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
    from k3jax.checkpoint.vision_names import to_hf, vision_tensor_map

    if k3.vision is None:
        raise K3JaxError("the checkpoint holds vision params but its config.json has no vision_config")
    for e in vision_tensor_map(k3.vision):
        out.add(e.hf, _cast(to_hf(e, leaves.get(e.path, e.index)), dtypes.get(e.hf, "BF16"), casts))


def export(ckpt_dir, hf_dir, *, experts_bf16: bool = False, max_shard_bytes: int = DEFAULT_SHARD_BYTES,
           progress: bool = False, log=None, merge_lora: bool = False) -> dict:
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
    # what the run is decides the export's kind: said before any format question
    lora_run = _is_lora_run(src)
    if lora_run and not merge_lora:
        raise K3JaxError(f"{src.describe()} is a LoRA run: its checkpoints hold adapters, not a model; export "
                         "them with --adapter (a PEFT directory) or fold them into the base with --merge-lora")
    if merge_lora and not lora_run:
        raise K3JaxError(f"{src.describe()}: --merge-lora needs a LoRA run (lora.rank > 0)")
    if not experts_bf16 and cfg.num_experts and not _has_quantization_config(hf_config):
        raise K3JaxError(f"{src.describe()}: its config.json has no quantization_config describing MXFP4 "
                         "experts (a config without MXFP4 experts); export with --experts-bf16")

    if src.kind == "orbax" and (src.path / "extra").exists():
        # the first conversions kept vision tensors verbatim there; exporting without them
        # would silently drop the vision tower
        raise K3JaxError(f"{src.path}: vision tensors in extra/ come from an older `k3jax convert`; "
                         "convert the HF directory again")
    qat = src.kind == "run" and bool(src.train.get("qat"))
    params = (_lora_source(src, qat) if lora_run
              else _Source(_Leaves(src.item_dir, src.prefix), qat=qat, init=_run_init(src)))
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
            if not e.is_expert:
                slot, d = params.dense(e.path, e.index)
                shape = stored_shape(e, slot.shape, cfg, layout)
                dtype = release_dtype(e.hf)
                if dtype != "F32" and e.path in keep_fp32 and slot.dtype == np.float32:
                    dtype, kept = "F32", kept + 1
                if d is not None and params.lost is not None:
                    # a QAT forward saw the stored value itself (k3jax.train.qat, Dense)
                    stored = slot.astype(DTYPES[dtype])
                    params.lost.add("bf16 weights", e.hf, stored if qat else slot, stored, d)
                out.add(e.hf, _cast(from_tree_layout(e, slot, shape), dtype, casts))
                bar.update(1)
                continue
            w, packed, scale, d = params.expert(e)
            if experts_bf16:
                w = dequantize_mxfp4_np(packed, scale) if w is None else w
                if d is not None and params.lost is not None:   # a QAT forward saw MXFP4, not bf16
                    seen = dequantize_mxfp4_np(*quantize_mxfp4(w.astype(np.float32))) if qat else w
                    params.lost.add("experts", e.hf, seen, w.astype(DTYPES["BF16"]), d)
                out.add(f"{e.hf}.weight", _cast(w, "BF16", casts))
            elif packed is not None:            # MXFP4-resident and unchanged: its own bytes
                out.add(f"{e.hf}.weight_packed", packed)
                out.add(f"{e.hf}.weight_scale", scale)
            else:
                orig = scales.get(e.path, e.index) if scales is not None and e.path in scales.paths else None
                packed, scale = _pack_expert(w.astype(np.float32), None if d is not None else orig)
                if d is not None:
                    stored = dequantize_mxfp4_np(packed, scale, np.float64)
                    if params.requant is not None:
                        params.requant.add(e.hf, w, stored, d)
                    # a QAT forward multiplied by exactly these values (k3jax.ops.qat)
                    params.lost.add("experts", e.hf, stored if qat else w, stored, d)
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
    result = {"total_size": out.total, "shards": len(out.files), "tensors": sum(len(n) for _, n in out.files),
              "source": src.describe(), "casts": casts, "kept_fp32": kept}
    if params.requant is not None and not experts_bf16:
        result["requant"] = params.requant.summary()
    if params.lost is not None:
        result["lost"] = params.lost.summary()
    return result


def _is_lora_run(src) -> bool:
    return src.kind == "run" and bool((src.train.get("lora") or {}).get("rank"))


def _init_source(src):
    """A LoRA run's base as a ModelSource (its init_from), None for a random init."""
    init_from = src.train.get("init_from")
    return resolve(init_from) if init_from else None


def _run_init(src):
    """A full fine-tune's initial weights as a _Source (its init_from, else its seed's random
    init, regenerated as the run drew it), for the size of its update; None for anything
    but a full fine-tune."""
    if src.kind != "run" or _is_lora_run(src):
        return None
    base_src = _init_source(src)
    if base_src is not None and base_src.kind in ("orbax", "run") and not _is_lora_run(base_src):
        return _Source(_Leaves(base_src.item_dir, base_src.prefix))
    if base_src is not None:   # an HF directory: in memory (small models), experts widened
        from k3jax.checkpoint.load import load_model_dir
        _, params = load_model_dir(base_src, {"param_dtype": "float32", "expert_format": "bf16"})
        return _Source(_Tree(params))
    import jax

    from k3jax.checkpoint.load import load_config
    from k3jax.model import init_params
    cfg = load_config(src).text.with_runtime(qat=False, lora=None)
    return _Source(_Tree(jax.jit(lambda k: init_params(cfg, k))(jax.random.PRNGKey(int(src.train.get("seed", 0))))))


def _lora_source(src, qat: bool = False) -> _Source:
    """A LoRA run's export source: its base (init_from's leaves, streamed when that is a
    k3jax checkpoint; else loaded whole) and its adapters from the run's checkpoint."""
    from k3jax import lora
    from k3jax.checkpoint.load import load_model_dir
    from k3jax.model import abstract_params
    cfg = src.k3.text
    spec = lora.resolve(src.train["lora"], cfg, abstract_params(cfg))
    adapters = _Leaves(src.item_dir, tuple(src.prefix) + ("lora",))
    base_src = _init_source(src)
    if base_src is not None and base_src.kind in ("orbax", "run") and not _is_lora_run(base_src):
        base = _Leaves(base_src.item_dir, base_src.prefix)
    else:   # an HF directory or a random init: the base in memory (small models)
        _, params = load_model_dir(src.path, {"param_dtype": "float32"})
        base = _Tree({k: v for k, v in params.items() if k != "lora"})
    # router biases come from the run: Quantile Balancing re-solved them while training
    biases = _Leaves(src.item_dir, src.prefix)
    return _Source(_WithRun(base, biases), adapters, spec, cfg, qat=qat)


class _RouterWeights:
    """layer -> the router weight [experts, hidden] of a LoRA run's model as its base stores
    it (the checkpoint's layout and dtype): LoRA keeps the gate frozen, so it is the base's
    (the run's own, were it ever saved). One tensor a layer is read: by name from an HF base,
    a leaf slice from a k3jax one; a random-init base is regenerated whole (small models),
    on the first call only (a run that froze its router asks for none)."""

    def __init__(self, src):
        self.src, self.cfg = src, src.k3.text
        self.run = _Leaves(src.item_dir, src.prefix)
        self.ckpt = self.base = None

    def _open(self):
        from k3jax.checkpoint.adapters import ROUTER_WEIGHT
        base_src = _init_source(self.src)
        if base_src is not None and base_src.kind == "hf":
            from k3jax.checkpoint.safetensors_io import ShardedCheckpoint
            self.ckpt = ShardedCheckpoint(base_src.path)
            self.names = {(e.path, e.index): e.hf for e in tensor_map(self.cfg, base_src.layout)
                          if e.path[-len(ROUTER_WEIGHT):] == ROUTER_WEIGHT}
        elif base_src is not None and not _is_lora_run(base_src):
            self.base = _Leaves(base_src.item_dir, base_src.prefix)
        else:   # a random init (or a LoRA run's base): the params as the run loads them
            from k3jax.checkpoint.load import load_model_dir
            _, params = load_model_dir(self.src.path)
            self.base = _Tree({k: v for k, v in params.items() if k != "lora"})

    def __call__(self, layer: int) -> np.ndarray:
        from k3jax.checkpoint.adapters import ROUTER_WEIGHT
        from k3jax.checkpoint.names import layer_location
        loc, idx = layer_location(self.cfg, layer)
        path = loc + ROUTER_WEIGHT
        if path in self.run.paths:
            return np.ascontiguousarray(self.run.get(path, idx).T)     # tree [in, out] -> [out, in]
        if self.ckpt is None and self.base is None:
            self._open()
        if self.ckpt is not None:
            return self.ckpt.get(self.names[(path, idx)])
        return np.ascontiguousarray(self.base.get(path, idx).T)

    def close(self) -> None:
        if self.ckpt is not None:
            self.ckpt.close()


class _WithRun:
    """A base's leaves with the run's own saved non-adapter leaves (router biases) over them."""

    def __init__(self, base, run):
        self.base, self.run = base, run
        self.paths = base.paths | {p for p in run.paths if p[0] != "lora"}

    def get(self, path, index):
        return (self.run if path in self.run.paths else self.base).get(path, index)


def _model_fp32_paths(cfg) -> set:
    """Param paths the model keeps in fp32 even when its params are bf16."""
    import jax

    from k3jax.model import param_shapes
    tree = param_shapes(cfg.with_runtime(param_dtype="bfloat16"))
    return {tuple(k.key for k in p) for p, leaf in jax.tree_util.tree_leaves_with_path(tree)
            if leaf.dtype == np.float32}


def _has_quantization_config(hf_config: dict) -> bool:
    return bool(hf_config.get("text_config", hf_config).get("quantization_config")
                or hf_config.get("quantization_config"))


def export_adapter(run_dir, out_dir, log=None) -> dict:
    """A LoRA run's adapters (its newest checkpoint, or the checkpoints/N given) as a PEFT
    directory (`k3jax.checkpoint.adapters`). Returns {'tensors', 'bytes', 'source', 'rank',
    'targets'}."""
    from k3jax import lora
    from k3jax.checkpoint.adapters import write_adapter
    from k3jax.model import abstract_params

    out_dir = local_path(out_dir, "output")
    src = resolve(run_dir)
    if not _is_lora_run(src):
        raise K3JaxError(f"{src.describe()}: --adapter exports a LoRA run's adapters (a run with lora.rank > 0)")
    if out_dir.exists():
        raise FileExistsError(f"{out_dir} already exists; refusing to overwrite it")
    cfg = src.k3.text
    spec = lora.resolve(src.train["lora"], cfg, abstract_params(cfg))
    adapters = _Leaves(src.item_dir, tuple(src.prefix) + ("lora",))
    trained = _Leaves(src.item_dir, tuple(src.prefix))   # the router biases, when saved
    gates = _RouterWeights(src)
    remove_stale_temps(out_dir, log)
    tmp = temp_sibling(out_dir)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    try:
        r = write_adapter(tmp, cfg, spec, adapters, src.layout, src.dense_mlp_name,
                          base_model=str(src.train.get("init_from") or ""), trained=trained, gate_weight=gates)
        os.rename(tmp, out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    finally:
        gates.close()
    return {**r, "source": src.describe(), "rank": spec.rank, "targets": sorted(spec.targets)}
