"""Sigmoid router and Stable LatentMoE (SPEC.md §5), with interchangeable dispatches.

`dense` runs every expert on every token (an einsum; small and obviously right, the CPU
oracle); `ragged` sorts the (token, expert) pairs by expert and runs one grouped matmul
(`jax.lax.ragged_dot`) per weight — dropless, no capacity factor. Both combine in fp32.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import linen as nn

from k3jax.config import ModelConfig
from k3jax.layers.common import HIGHEST, compute_dtype, dense, logical, matrix_init, param_dtype
from k3jax.layers.mlp import GatedMLP, glu_activation
from k3jax.layers.norms import RMSNorm


def route(x, gate_w, bias, top_k: int, renormalize: bool, scaling: float):
    """Sigmoid scores in fp32; the bias only selects, the weights use unbiased scores.

    Returns (idx [N, k] int32, weights [N, k] fp32, scores [N, E] fp32).
    """
    logits = jnp.einsum("nd,de->ne", x.astype(jnp.float32), gate_w.astype(jnp.float32), precision=HIGHEST)
    scores = jax.nn.sigmoid(logits)
    _, idx = jax.lax.top_k(scores + jax.lax.stop_gradient(bias.astype(jnp.float32)), top_k)
    w = jnp.take_along_axis(scores, idx, axis=-1)
    if renormalize and top_k > 1:
        w = w / (jnp.sum(w, axis=-1, keepdims=True) + 1e-20)
    return idx.astype(jnp.int32), w * scaling, scores


def experts_dense(cfg: ModelConfig, z, idx, w, w1, w2, w3):
    """Every expert on every token, combined with a [N, E] weight matrix (zero off top-k)."""
    comb = jnp.sum(jax.nn.one_hot(idx, w1.shape[0], dtype=jnp.float32) * w[..., None], axis=1)
    g = jnp.einsum("nd,edf->nef", z, w1)
    u = jnp.einsum("nd,edf->nef", z, w3)
    out = jnp.einsum("nef,efd->ned", glu_activation(cfg, g, u), w2)
    return jnp.einsum("ne,ned->nd", comb, out.astype(jnp.float32), precision=HIGHEST)


def experts_ragged(cfg: ModelConfig, z, idx, w, w1, w2, w3):
    """Sort (token, slot) pairs by expert, grouped matmuls, unsort, fp32 combine."""
    n, k = idx.shape
    flat = idx.reshape(-1)
    order = jnp.argsort(flat, stable=True)
    rows = z[order // k]
    sizes = jnp.bincount(flat, length=w1.shape[0]).astype(jnp.int32)
    g = jax.lax.ragged_dot(rows, w1, sizes)
    u = jax.lax.ragged_dot(rows, w3, sizes)
    out = jax.lax.ragged_dot(glu_activation(cfg, g, u), w2, sizes)
    unsorted = jnp.zeros_like(out).at[order].set(out)
    return jnp.einsum("nkd,nk->nd", unsorted.reshape(n, k, -1).astype(jnp.float32), w, precision=HIGHEST)


DISPATCH = {"dense": experts_dense, "ragged": experts_ragged}


class StableLatentMoE(nn.Module):
    """Router → latent down-projection → routed experts → RMSNorm → up-projection, plus
    the shared experts on the unprojected input. Without a latent (Kimi-Linear) the
    experts run at model width and there is no down/up/norm."""
    cfg: ModelConfig

    @nn.compact
    def __call__(self, x):
        cfg = self.cfg
        E, k, D, F = cfg.num_experts, cfg.num_experts_per_token, cfg.hidden_size, cfg.moe_intermediate_size
        H = cfg.moe_hidden_size
        shape = x.shape
        xf = x.reshape(-1, D)
        gate_w = self.param("gate", logical(nn.initializers.normal(0.02), ("embed", "expert")), (D, E), param_dtype(cfg))
        bias = self.param("e_score_correction_bias", logical(nn.initializers.zeros, ("expert",)), (E,), jnp.float32)
        idx, w, scores = route(xf, gate_w, bias, k, cfg.moe_renormalize, cfg.routed_scaling_factor)
        self.sow("intermediates", "router_scores", scores)
        self.sow("intermediates", "router_idx", idx)

        z = dense(cfg, H, ("embed", "latent"), "routed_expert_down_proj")(xf) if cfg.use_latent_moe else xf
        pdt, cdt = param_dtype(cfg), compute_dtype(cfg)
        w1 = self.param("w1", matrix_init(("expert", "latent", "mlp")), (E, H, F), pdt).astype(cdt)
        w3 = self.param("w3", matrix_init(("expert", "latent", "mlp")), (E, H, F), pdt).astype(cdt)
        w2 = self.param("w2", matrix_init(("expert", "mlp", "latent")), (E, F, H), pdt).astype(cdt)
        y = DISPATCH[cfg.runtime.moe_dispatch](cfg, z.astype(cdt), idx, w, w1, w2, w3).astype(cdt)
        if cfg.use_latent_moe:
            if cfg.latent_moe_use_norm:
                y = RMSNorm(cfg.rms_norm_eps, "latent", name="routed_expert_norm")(y)
            y = dense(cfg, D, ("latent", "embed"), "routed_expert_up_proj")(y)
        if cfg.num_shared_experts:
            y = y + GatedMLP(cfg, cfg.shared_intermediate_size, name="shared_experts")(xf)
        return y.reshape(shape)
