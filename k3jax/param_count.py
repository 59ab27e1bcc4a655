"""Total and activated parameter counts from abstract shapes (`jax.eval_shape`, nothing allocated).

Counted as the checkpoint stores them (SPEC.md §1), so K3's A_log counts its zero padding.
Activated = everything a token touches: attention, dense MLP, per MoE layer the router,
latent down/up, shared experts and top-k routed experts, lm_head — not the embedding lookup.
"""
from __future__ import annotations

import math

import jax

from k3jax.checkpoint.names import stored_shape, tensor_map
from k3jax.config import ModelConfig
from k3jax.model import param_shapes


def count_params(cfg: ModelConfig, layout: str = "k3") -> dict:
    shapes = param_shapes(cfg)
    leaves = {tuple(k.key for k in p): leaf.shape for p, leaf in jax.tree_util.tree_leaves_with_path(shapes)}
    total = routed = embed = 0
    for e in tensor_map(cfg, layout):
        n = math.prod(stored_shape(e, leaves[e.path][len(e.index):], cfg, layout))
        total += n
        routed += n if e.is_expert else 0
        embed += n if e.path[0] == "embed_tokens" else 0
    active_routed = routed * cfg.num_experts_per_token // cfg.num_experts if cfg.num_experts else 0
    return {"total": total, "active": total - embed - routed + active_routed,
            "routed_experts": routed, "embedding": embed}
