"""Gated Multi-head Latent Attention without positions (SPEC.md §4).

The 64 "rope" dims of q and the shared k_r head are used as they are: Kimi's MLA is NoPE.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import linen as nn

from k3jax.config import ModelConfig
from k3jax.layers.common import compute_dtype, dense
from k3jax.layers.norms import RMSNorm


def attention_mask(T: int, segment_ids=None):
    """[B or 1, 1, T, T] bool: causal, and never across packed documents."""
    causal = jnp.tril(jnp.ones((T, T), bool))[None, None]
    if segment_ids is None:
        return causal
    same = segment_ids[:, None, :, None] == segment_ids[:, None, None, :]
    return causal & same


def softmax_attention(q, k, v, mask, scale: float):
    """q, k [B, T, H, Dk], v [B, T, H, Dv]; scores and softmax in fp32."""
    s = jnp.einsum("bqhd,bkhd->bhqk", q.astype(jnp.float32), k.astype(jnp.float32)) * scale
    s = jnp.where(mask, s, -jnp.inf)
    p = jax.nn.softmax(s, axis=-1)
    return jnp.einsum("bhqk,bkhd->bqhd", p, v.astype(jnp.float32)).astype(v.dtype)


class GatedMLA(nn.Module):
    cfg: ModelConfig

    @nn.compact
    def __call__(self, x, segment_ids=None):
        cfg = self.cfg
        H, dn, dr, dv = cfg.num_attention_heads, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim
        B, T, _ = x.shape
        if cfg.q_lora_rank is not None:
            q = dense(cfg, cfg.q_lora_rank, ("embed", "q_lora"), "q_a_proj")(x)
            q = RMSNorm(cfg.mla_norm_eps, "q_lora", name="q_a_layernorm")(q)
            q = dense(cfg, H * cfg.q_head_dim, ("q_lora", "heads_x_dim"), "q_b_proj")(q)
        else:
            q = dense(cfg, H * cfg.q_head_dim, ("embed", "heads_x_dim"), "q_proj")(x)
        q = q.reshape(B, T, H, cfg.q_head_dim)

        ckv = dense(cfg, cfg.kv_lora_rank + dr, ("embed", "kv_lora"), "kv_a_proj_with_mqa")(x)
        c = RMSNorm(cfg.mla_norm_eps, "kv_lora", name="kv_a_layernorm")(ckv[..., :cfg.kv_lora_rank])
        k_r = ckv[..., cfg.kv_lora_rank:]
        kv = dense(cfg, H * (dn + dv), ("kv_lora", "heads_x_dim"), "kv_b_proj")(c).reshape(B, T, H, dn + dv)
        k = jnp.concatenate([kv[..., :dn], jnp.broadcast_to(k_r[:, :, None, :], (B, T, H, dr))], axis=-1)
        o = softmax_attention(q, k, kv[..., dn:], attention_mask(T, segment_ids), cfg.q_head_dim ** -0.5)
        o = o.reshape(B, T, H * dv)
        if cfg.mla_use_output_gate:
            o = o * jax.nn.sigmoid(dense(cfg, H * dv, ("embed", "heads_x_dim"), "g_proj")(x))
        return dense(cfg, cfg.hidden_size, ("heads_x_dim", "embed"), "o_proj")(o.astype(compute_dtype(cfg)))
