"""Per-device memory plan for a config on a mesh preset, from abstract shapes only.

Params, gradients and optimizer state are exact for the sharding the preset's rules give
(`k3jax.sharding.fit_spec`, the same rule `param_shardings` applies). Activations are an
estimate per layer, counted per token from the layer's intermediate tensors, for each remat
policy; caches are exact. Nothing is allocated, so this runs for full K3 on a laptop.
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import jax
import numpy as np
from flax import linen as nn

from k3jax.config import ModelConfig
from k3jax.sharding import MeshPreset, entry_axes, fit_spec

GIB = 1 << 30
MXFP4_BYTES = 17 / 32   # 4-bit E2M1 value + one E8M0 scale byte per 32 (SPEC.md §6)


@dataclass(frozen=True)
class PlanOptions:
    mode: str = "train"              # 'train' | 'infer'
    batch: int | None = None         # global sequences; default one per batch shard
    seq: int = 4096
    remat: str = "full"              # 'none' | 'dots' | 'full'
    optimizer: str = "adamw"         # 'adamw' (fp32 m + v) | 'muon' (fp32 momentum on matrices)
    param_dtype: str = "bfloat16"
    expert_format: str = "bf16"      # 'bf16' | 'mxfp4' (routed experts as the checkpoint stores them)
    devices: int | None = None       # resolves a -1 axis in the preset
    hbm_gib: float | None = None
    moe_dispatch: str = "ep"
    ep_capacity_factor: float = 0.0  # RuntimeOptions.ep_capacity_factor: 0 = dropless
    prefill_chunk: int = 2048        # infer: tokens per device per prefill step


def _sizes(spec, sizes: dict) -> int:
    n = 1
    for axes in spec:
        for a in entry_axes(axes):
            n *= sizes[a]
    return n


def _is_expert(path) -> bool:
    return path[-1] in ("w1", "w2", "w3")


def _uses_muon(path, names) -> bool:
    # Per-Head Muon orthogonalises hidden weight matrices; embeddings, lm_head and vectors
    # (norms, biases, gates' scalars) stay on AdamW, as in Moonshot's recipe.
    core = [n for n in names if n not in ("layers", "expert")]
    return len(core) >= 2 and path[0] not in ("embed_tokens", "lm_head")


@functools.lru_cache(maxsize=8)
def _abstract(cfg: ModelConfig):
    from k3jax.model import abstract_params
    return abstract_params(cfg)     # ~5 s for full K3 (tracing only): cached per config


def state_bytes(cfg: ModelConfig, preset: MeshPreset, opt: PlanOptions) -> dict:
    """Exact per-device bytes of params, gradients and optimizer state."""
    sizes = preset.shape(opt.devices)
    boxed = _abstract(cfg.with_runtime(param_dtype=opt.param_dtype))
    names = nn.get_partition_spec(boxed)
    mesh_specs = nn.logical_to_mesh(names, preset.rules)
    out = dict(params=0, grads=0, optimizer=0)
    leaves = jax.tree_util.tree_leaves_with_path(nn.unbox(boxed))
    flat_names = jax.tree.leaves(names, is_leaf=lambda x: isinstance(x, jax.sharding.PartitionSpec))
    flat_specs = jax.tree.leaves(mesh_specs, is_leaf=lambda x: isinstance(x, jax.sharding.PartitionSpec))
    for (path, leaf), lnames, spec in zip(leaves, flat_names, flat_specs):
        keys = tuple(k.key for k in path)
        local = math.prod(leaf.shape) // _sizes(fit_spec(leaf.shape, spec, sizes), sizes)
        width = np.dtype(leaf.dtype).itemsize
        stored = MXFP4_BYTES if opt.expert_format == "mxfp4" and _is_expert(keys) else width
        out["params"] += local * stored
        out["grads"] += local * width
        muon = opt.optimizer == "muon" and _uses_muon(keys, tuple(lnames))
        out["optimizer"] += local * (4 if muon else 8)
    return {k: int(v) for k, v in out.items()}


def _shards(rules, sizes: dict, logical: tuple[str, ...]) -> int:
    return _sizes(tuple(nn.logical_to_mesh_axes(logical, rules)), sizes)


def layer_values(cfg: ModelConfig, kind: tuple[str, str], T: int, tp: int) -> dict:
    """Values kept per token by one layer: {'dots': matmul outputs, 'all': everything}
    ('all' adds elementwise results, norms, attention probabilities and KDA chunk states).
    Head- and hidden-sized terms are divided by the tensor-parallel degree `tp`."""
    D, H = cfg.hidden_size, cfg.num_attention_heads
    attn, ffn = kind
    dots = other = 0.0
    if attn == "kda":
        hd, C, r = cfg.kda_num_heads * cfg.kda_head_dim, cfg.runtime.kda_chunk_size, cfg.kda_head_dim
        dots += (5 * hd + cfg.kda_num_heads) / tp + r + D        # q,k,v,f_b,g_proj, beta, f_a, o_proj
        # conv + SiLU on q,k,v, L2 norms, gate, o, o-norm, gated o; per chunk: A, T [C, C],
        # W, U [C, d] and the carried state [d, d], per head (fp32, counted twice)
        other += 12 * hd / tp + 2 * cfg.kda_num_heads * (2 * C + 2 * cfg.kda_head_dim
                                                         + cfg.kda_head_dim ** 2 / C) / tp
    else:
        hv = H * cfg.v_head_dim
        dots += (cfg.q_lora_rank or 0) + (H * cfg.q_head_dim + H * (cfg.qk_nope_head_dim + cfg.v_head_dim)
                                          + hv) / tp + cfg.mla_cache_dim + D
        other += (H * cfg.q_head_dim * 2 + 2 * hv) / tp + 2 * 2 * H * T / tp   # q/k concat; fp32 scores + probs
    if ffn == "moe":
        k, F, Hl, Fs = cfg.num_experts_per_token, cfg.moe_intermediate_size, cfg.moe_hidden_size, cfg.shared_intermediate_size
        dots += 2 * 2 * cfg.num_experts + Hl + k * (2 * F / tp + Hl) + D + 2 * Fs / tp + D
        other += k * (F / tp + Hl) + 2 * Hl + Fs / tp + k
    else:
        dots += 2 * cfg.intermediate_size / tp + D
        other += cfg.intermediate_size / tp
    other += 4 * D                                               # two RMSNorms, two AttnRes mixes
    return {"dots": dots, "all": dots + other}


def activation_bytes(cfg: ModelConfig, preset: MeshPreset, opt: PlanOptions, batch: int) -> dict:
    """Estimated per-device activation bytes: saved for backward plus one layer's peak."""
    sizes = preset.shape(opt.devices)
    rules = preset.rules
    tokens = batch * opt.seq / _shards(rules, sizes, ("batch", "length"))
    if opt.mode == "infer":
        tokens = min(tokens, opt.prefill_chunk)     # prefill runs in chunks; decode is 1 token
    tp = _shards(rules, sizes, ("heads",))
    T_local = opt.seq / _shards(rules, sizes, ("length",))
    kinds = list(zip(cfg.layer_kinds, cfg.ffn_kinds))
    width = np.dtype(cfg.runtime.dtype if opt.param_dtype == "float32" else "bfloat16").itemsize
    per_layer = [layer_values(cfg, kd, T_local, tp) for kd in kinds]
    peak_layer = max(v["all"] for v in per_layer) * tokens * width
    # The residual carry is saved at every layer whatever the policy; with Block AttnRes it
    # includes the block stack (max_attn_res_blocks × D per token), the largest fixed term.
    carry = (1 + cfg.max_attn_res_blocks) * cfg.hidden_size
    saved_per_token = {"full": carry * len(kinds),
                       "dots": sum(v["dots"] for v in per_layer) + carry * len(kinds),
                       "none": sum(v["all"] for v in per_layer) + carry * len(kinds)}[opt.remat]
    # 'ep' receive buffers, once as input and once as result (ragged_all_to_all, TPU/GPU):
    # dropless, one device may receive every pair of every peer (P × tokens × k rows); with
    # a capacity factor c, c × tokens × k rows (layers/moe.py).
    P = sizes.get("expert", 1)
    moe_buffer = 0
    if cfg.num_experts and opt.moe_dispatch == "ep" and P > 1:
        from k3jax.layers.moe import ep_receive_rows
        rows = ep_receive_rows(tokens * cfg.num_experts_per_token, P, opt.ep_capacity_factor)
        moe_buffer = 2 * rows * cfg.moe_hidden_size * width
    vocab_local = cfg.vocab_size / _shards(rules, sizes, ("vocab",))
    logits = 2 * tokens * vocab_local * 4   # fp32 logits + grad
    # TokenEmbed gathers the embed-sharded table for the lookup, and in training the lookup's
    # backward scatter-adds into a whole fp32 table before it reduces onto the shards.
    embed_table = 0
    if _shards(rules, sizes, ("embed",)) > 1:
        embed_table = vocab_local * cfg.hidden_size * (width + (4 if opt.mode == "train" else 0))
    if opt.mode == "infer":
        return {"saved": 0, "layer_peak": int(peak_layer), "moe_buffer": int(moe_buffer), "logits": int(logits / 2),
                "embed_table": int(embed_table)}
    return {"saved": int(saved_per_token * tokens * width), "layer_peak": int(peak_layer),
            "moe_buffer": int(moe_buffer), "logits": int(logits), "embed_table": int(embed_table)}


def cache_bytes(cfg: ModelConfig, preset: MeshPreset, opt: PlanOptions, batch: int) -> dict:
    """Per-device inference caches for `batch` sequences of `seq` tokens."""
    sizes = preset.shape(opt.devices)
    seqs = batch / _shards(preset.rules, sizes, ("batch",))
    n_kda, n_mla = cfg.layer_kinds.count("kda"), cfg.layer_kinds.count("mla")
    H, d = cfg.kda_num_heads, cfg.kda_head_dim
    tp = _shards(preset.rules, sizes, ("heads",)) if H % _shards(preset.rules, sizes, ("heads",)) == 0 else 1
    kda_state = n_kda * H * d * d * 4 / tp                                     # fp32 S per layer
    conv = n_kda * 3 * (cfg.short_conv_kernel_size - 1) * H * d * 2 / tp       # bf16 conv tails
    mla = n_mla * cfg.mla_cache_dim * opt.seq * 2                              # bf16 latent KV, one shared head
    return {"kda_state": int(seqs * kda_state), "kda_conv": int(seqs * conv), "mla_kv": int(seqs * mla)}


def plan(cfg: ModelConfig, preset: MeshPreset, opt: PlanOptions, total_params: int) -> dict:
    sizes = preset.shape(opt.devices)
    batch = opt.batch or _shards(preset.rules, sizes, ("batch",))
    state = state_bytes(cfg, preset, opt)
    act = activation_bytes(cfg, preset, opt, batch)
    caches = cache_bytes(cfg, preset, opt, batch)
    if opt.mode == "train":
        parts = {"params": state["params"], "grads": state["grads"], "optimizer": state["optimizer"],
                 "activations": sum(act.values())}
    else:
        parts = {"params": state["params"], "caches": sum(caches.values()), "activations": sum(act.values())}
    total = sum(parts.values())
    hbm_gib = opt.hbm_gib if opt.hbm_gib is not None else preset.hbm_gib
    hbm = int(hbm_gib * GIB) if hbm_gib else None
    n_kda, n_mla = cfg.layer_kinds.count("kda"), cfg.layer_kinds.count("mla")
    return {
        "mesh": preset.name, "mesh_shape": {a: s for a, s in sizes.items() if s > 1},
        "devices": math.prod(sizes.values()), "mode": opt.mode, "batch": batch, "seq": opt.seq,
        "remat": opt.remat, "optimizer": opt.optimizer, "expert_format": opt.expert_format,
        "params": int(total_params),
        "mla_cache_values_per_token": n_mla * cfg.mla_cache_dim,
        "kda_state_values_per_sequence": n_kda * cfg.kda_num_heads * cfg.kda_head_dim * cfg.kda_head_dim,
        "bytes_per_device": {**parts, "total": total},
        "detail": {"state": state, "activations": act, "caches": caches},
        "hbm_bytes": hbm, "fits": bool(hbm is not None and total <= hbm),
    }
