"""One entry point for "give me a model from this directory", for every command and `init_from=`.

A model directory is any of:

  hf     an HF safetensors directory: config.json + model.safetensors[.index.json[.gz]]
  orbax  a `k3jax convert` output: config.json + params/ + the manifest (k3jax_checkpoint.json)
  run    a training run directory (config.yaml + checkpoints/N/): its newest finished
         checkpoint, or one of its `checkpoints/N` for that step

`resolve` says which (reading configs and directory listings only); `load_config` gives the
K3Config; `load_model_dir` the params. From a run only the params are read, not the
optimizer state: Orbax's partial restore reads just the `params` subtree of the saved
TrainState, each leaf straight onto its target sharding.
"""
from __future__ import annotations

import dataclasses
import json
import sys
from dataclasses import dataclass, field
from pathlib import Path

from k3jax.checkpoint.dirs import (FORMAT, MANIFEST, PARAMS_KEY, RUN_CHECKPOINTS, RUN_CONFIG, STATE_ITEM,
                                   checkpoint_steps, local_path)
from k3jax.config import EXPERT_ROLES, ConfigError, K3Config, RuntimeOptions, load_k3
from k3jax.errors import K3JaxError

__all__ = ["ModelSource", "resolve", "load_model_dir", "is_orbax_dir", "is_model_dir", "load_config",
           "load_any_config", "local_path"]

# Runtime options a run's own train config supplies when a command loads the run (the
# dtypes it trained in); the rest (kernels, dispatch, remat) are the caller's choice.
_RUN_RUNTIME_KEYS = ("dtype", "param_dtype", "expert_format")


@dataclass(frozen=True)
class ModelSource:
    """Where a model directory's config and params are (see the module docstring)."""
    path: Path                  # the directory as given
    kind: str                   # 'hf' | 'orbax' | 'run'
    k3: K3Config                # default RuntimeOptions; `load_config` applies runtimes
    item_dir: Path | None       # the Orbax item holding the text params (None for hf)
    prefix: tuple = ()          # the params' path inside that item (('params',) for a run)
    step: int | None = None     # run: the checkpoint's step
    run_dir: Path | None = None
    train: dict = field(default_factory=dict, repr=False)      # run: its resolved train config
    manifest: dict = field(default_factory=dict, repr=False)   # orbax: the convert manifest

    @property
    def layout(self) -> str:
        return self.manifest.get("layout", self.k3.layout)

    @property
    def stored_expert_format(self) -> str:
        """How the routed experts are saved: 'mxfp4' (packed bytes) or 'bf16' (widened)."""
        if self.kind == "run":
            return (self.train.get("runtime") or {}).get("expert_format") or "bf16"
        return self.manifest.get("expert_format", "bf16")

    @property
    def dense_mlp_name(self) -> str:
        return self.manifest.get("dense_mlp_name", "mlp")

    @property
    def vision_dir(self) -> Path | None:
        """The Orbax vision item of a convert output that has one."""
        if self.kind == "orbax" and (self.path / "vision" / "_METADATA").exists():
            return self.path / "vision"
        return None

    def describe(self) -> str:
        if self.kind == "run":
            return f"run {self.run_dir} at step {self.step}"
        return f"{'k3jax checkpoint' if self.kind == 'orbax' else 'HF checkpoint'} {self.path}"

    def runtime(self, overrides: dict | None = None) -> dict:
        """RuntimeOptions for loading: a run's training dtypes (and its `qat`: a QAT run's
        forward sees its weights as the export stores them), then `overrides`."""
        base = {}
        if self.kind == "run":
            rt = self.train.get("runtime") or {}
            base = {k: rt[k] for k in _RUN_RUNTIME_KEYS if rt.get(k) is not None}
            if self.train.get("qat"):
                base["qat"] = True
        return {**base, **{k: v for k, v in (overrides or {}).items() if v is not None}}


_WHAT = ("expected an HF checkpoint (config.json + safetensors), a `k3jax convert` output, a training "
         "run directory (config.yaml + checkpoints/) or one of its checkpoints/N")


def is_orbax_dir(path) -> bool:
    """A finished `k3jax convert` output (the manifest is written last)."""
    return (Path(path) / MANIFEST).is_file()


def is_model_dir(path) -> bool:
    """Whether `path` is a directory `resolve` would try to read as a model."""
    p = Path(path)
    return p.is_dir() and ((p / "config.json").is_file() or (p / RUN_CONFIG).is_file()
                           or p.name == RUN_CHECKPOINTS or (p / STATE_ITEM / "_METADATA").exists())


def resolve(path) -> ModelSource:
    """Which kind of model directory `path` is, and where its params are; reads only configs
    and listings. Errors name the directory and what it lacks."""
    path = local_path(path, "checkpoint")
    if not path.exists():
        raise FileNotFoundError(f"{path}: no such directory ({_WHAT})")
    if not path.is_dir():
        raise K3JaxError(f"{path}: not a directory ({_WHAT})")
    if (path / "config.json").is_file():
        k3 = K3Config.from_hf(path / "config.json")
        if is_orbax_dir(path):
            manifest = json.loads((path / MANIFEST).read_text())
            if manifest.get("format") != FORMAT:
                raise K3JaxError(f"{path / MANIFEST}: format {manifest.get('format')!r}, expected {FORMAT!r}")
            return ModelSource(path, "orbax", k3, path / "params", manifest=manifest)
        if (path / "params" / "_METADATA").exists():
            raise K3JaxError(f"{path}: has params/ but no {MANIFEST}: an unfinished conversion? convert again")
        return ModelSource(path, "hf", k3, None)
    # a run, its checkpoints/ folder, or one step of it
    if (path / RUN_CONFIG).is_file():
        run_dir, step = path, None
    elif path.name == RUN_CHECKPOINTS and (path.parent / RUN_CONFIG).is_file():
        run_dir, step = path.parent, None
    elif path.parent.name == RUN_CHECKPOINTS and (path.parent.parent / RUN_CONFIG).is_file():
        run_dir = path.parent.parent
        if not path.name.isdigit():
            raise K3JaxError(f"{path}: not a checkpoint step of {run_dir} (an unfinished write?)")
        step = int(path.name)
    else:
        raise FileNotFoundError(f"{path}: no config.json or {RUN_CONFIG} ({_WHAT})")
    steps = checkpoint_steps(run_dir / RUN_CHECKPOINTS)
    if step is None:
        if not steps:
            raise K3JaxError(f"{run_dir}: a training run without a finished checkpoint yet "
                             f"(nothing in {run_dir / RUN_CHECKPOINTS}); train it until its first checkpoint")
        step = steps[-1]
    elif step not in steps:
        raise K3JaxError(f"{path}: step {step} is not a finished checkpoint of {run_dir} "
                         f"(finished: {steps or 'none'})")
    k3 = load_k3(run_dir / RUN_CONFIG)
    train = dict(k3.train)
    k3 = dataclasses.replace(k3, train={})
    return ModelSource(path, "run", k3, run_dir / RUN_CHECKPOINTS / str(step) / STATE_ITEM, PARAMS_KEY,
                       step=step, run_dir=run_dir, train=train)


def _with_runtime(k3: K3Config, runtime: dict | None) -> K3Config:
    if not runtime:
        return k3
    unknown = sorted(set(runtime) - {f.name for f in dataclasses.fields(RuntimeOptions)})
    if unknown:
        raise ConfigError(f"unknown runtime option(s) {unknown}")
    return dataclasses.replace(k3, text=k3.text.with_runtime(**runtime))


def load_config(path, runtime: dict | None = None) -> K3Config:
    """The K3Config of a model directory (any kind), with RuntimeOptions overrides."""
    src = path if isinstance(path, ModelSource) else resolve(path)
    return _with_runtime(src.k3, src.runtime(runtime))


def load_any_config(name_or_path) -> K3Config:
    """A config from a preset name, YAML preset or config.json (`config.load_k3`), or from
    any model directory (`resolve`): what commands taking a CONFIG accept."""
    if is_model_dir(name_or_path):
        return resolve(name_or_path).k3
    return load_k3(name_or_path)


def load_model_dir(path, runtime: dict | None = None, shardings=None, *, vision: bool = False,
                   expert_format: str | None = None):
    """(K3Config, params) from any model directory (see the module docstring).

    `runtime`: RuntimeOptions overrides (e.g. {'param_dtype': 'bfloat16'}); a run supplies
    its training dtypes first. Every leaf is cast to the dtype the model uses for it under
    those options. Orbax checkpoints and runs restore onto the first device, or with
    `shardings` (a function ModelConfig -> NamedSharding tree) straight onto those
    shardings, each host reading only its shards; HF directories are read into host memory
    first (fine for small models; convert big ones first).

    `expert_format` ('bf16' | 'mxfp4'; shorthand for runtime={'expert_format': ...}):
    'mxfp4' keeps the routed experts as MXFP4 bytes (uint8 packed codes and E8M0 scales,
    17/32 byte per value), read as stored from MXFP4 files and quantized from widened ones;
    a checkpoint holding the other format is converted on load.

    A LoRA run (its train config has lora.rank > 0) holds only its adapters and router
    biases: the base comes from the run's `init_from` (or its seed, for a run from random
    init) and the adapters land under params['lora'], with `cfg.runtime.lora` set.

    `vision`: also load the vision tower and projector, when the checkpoint has them, under
    params['vision'] (`k3jax.model.multimodal`), in the text param dtype; with `shardings`
    they are replicated over the same mesh (0.45 B params in K3). Without, or when the
    checkpoint holds no vision weights (training runs hold the text model only), params
    are the text tree alone.
    """
    src = path if isinstance(path, ModelSource) else resolve(path)
    if expert_format is not None:
        runtime = {**(runtime or {}), "expert_format": expert_format}
    k3 = load_config(src, runtime)
    if src.kind == "run" and (src.train.get("lora") or {}).get("rank"):
        return _load_lora_run(src, k3, runtime, shardings)
    text_shardings = None if shardings is None else shardings(k3.text)
    if src.kind in ("orbax", "run"):
        from k3jax.checkpoint.orbax_io import restore_params

        stored = src.stored_expert_format
        if stored == k3.text.runtime.expert_format:
            params = restore_params(src.item_dir, k3.text, text_shardings, prefix=src.prefix)
        else:   # restored as saved, then widened or quantized onto the asked format
            if k3.text.runtime.expert_format == "mxfp4":   # lossy: said, never silent
                print(f"note: {src.describe()}: routed experts are stored as {stored}; quantizing them to "
                      f"MXFP4 on load (4-bit values, one shared scale per 32: not the stored weights)",
                      file=sys.stderr)
            as_stored = k3.text.with_runtime(expert_format=stored)
            params = restore_params(src.item_dir, as_stored, None if shardings is None else shardings(as_stored),
                                    prefix=src.prefix)
            params = convert_experts(params, k3.text.runtime.expert_format, text_shardings)
        if vision and k3.vision is not None and src.vision_dir is not None:
            from k3jax.checkpoint.orbax_io import restore_tree
            abstract = _vision_abstract(k3)
            params["vision"] = restore_tree(src.vision_dir, abstract, _replicated(abstract, text_shardings))
        return k3, params
    import jax
    import numpy as np

    from k3jax.checkpoint.hf_params import load_hf_params
    from k3jax.model import param_shapes

    params = load_hf_params(k3.text, src.path)
    dtypes = param_shapes(k3.text)
    params = jax.tree.map(lambda a, s: np.asarray(a, s.dtype), params, dtypes)
    if text_shardings is not None:
        params = jax.tree.map(jax.device_put, params, text_shardings)
    if vision and k3.vision is not None and _has_vision_tensors(src.path):
        from k3jax.checkpoint.vision_names import load_vision_params
        abstract = _vision_abstract(k3)
        tree = load_vision_params(k3.vision, src.path, np.float32)
        tree = jax.tree.map(lambda a, s: np.asarray(a, s.dtype), tree, abstract)
        if text_shardings is not None:
            tree = jax.tree.map(jax.device_put, tree, _replicated(abstract, text_shardings))
        params["vision"] = tree
    return k3, params


def _load_lora_run(src: ModelSource, k3: K3Config, runtime: dict | None, shardings):
    """A LoRA run's params: its base (the run's init_from, else its seed's random init) with
    the checkpoint's saved leaves (adapters and router biases) put over it."""
    import jax

    from k3jax import lora
    from k3jax.checkpoint.orbax_io import restore_tree, stored_leaves
    from k3jax.model import LORA_KEY, abstract_params, adapter_shapes, init_params, param_shapes

    base_cfg = k3.text
    spec = lora.resolve(src.train["lora"], base_cfg, abstract_params(base_cfg))
    cfg = base_cfg.with_runtime(lora=spec)
    k3 = dataclasses.replace(k3, text=cfg)
    init_from = src.train.get("init_from")
    if init_from:
        _, params = load_model_dir(init_from, {**src.runtime(runtime), "lora": None}, shardings)
    else:
        out = None if shardings is None else shardings(base_cfg)
        params = jax.jit(lambda key: init_params(base_cfg, key), out_shardings=out)(
            jax.random.PRNGKey(int(src.train.get("seed", 0))))
    full = {**param_shapes(cfg), LORA_KEY: adapter_shapes(cfg)}
    n = len(src.prefix)
    saved = {p[n:] for p in stored_leaves(src.item_dir) if p[:n] == tuple(src.prefix)}
    abstract = _subtree(full, saved)
    if not saved or LORA_KEY not in abstract:
        raise K3JaxError(f"{src.describe()}: its checkpoint holds no LoRA adapters")
    sh = None if shardings is None else _subtree(shardings(cfg), saved)
    restored = restore_tree(src.item_dir, abstract, sh, prefix=src.prefix)
    return k3, _overlay(params, restored)


def _subtree(tree: dict, paths: set, prefix=()) -> dict:
    """The part of a nested dict whose leaf paths are in `paths`."""
    out = {}
    for k, v in tree.items():
        if isinstance(v, dict):
            sub = _subtree(v, paths, prefix + (k,))
            if sub:
                out[k] = sub
        elif prefix + (k,) in paths:
            out[k] = v
    return out


def _overlay(base: dict, over: dict) -> dict:
    out = dict(base)
    for k, v in over.items():
        out[k] = _overlay(base[k], v) if isinstance(v, dict) and k in base else v
    return out


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
            if k in EXPERT_ROLES and expert_format == "bf16" and isinstance(v, dict):
                out[k] = dequantize_experts(MXFP4(v["weight_packed"], v["weight_scale"]), dtype)
            elif k in EXPERT_ROLES and expert_format == "mxfp4" and not isinstance(v, dict):
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
    from k3jax.checkpoint.vision_names import PREFIXES
    ckpt = ShardedCheckpoint(path)
    try:
        return any(n.startswith(PREFIXES) for n in ckpt.keys())
    finally:
        ckpt.close()
