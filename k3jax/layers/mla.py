"""Gated Multi-head Latent Attention without positions (SPEC.md §4).

The 64 "rope" dims of q and the shared k_r head are used as they are: Kimi's MLA is NoPE.
"""
from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import linen as nn

from k3jax.config import ModelConfig
from k3jax.layers.common import compute_dtype, constrain, dense, merged_kernel
from k3jax.layers.norms import RMSNorm
from k3jax.ops import latent_attention


def attention_mask(T: int, segment_ids=None):
    """[B or 1, 1, T, T] bool: causal, and never across packed documents."""
    causal = jnp.tril(jnp.ones((T, T), bool))[None, None]
    if segment_ids is None:
        return causal
    same = segment_ids[:, None, :, None] == segment_ids[:, None, None, :]
    return causal & same


def softmax_attention(q, k, v, mask, scale: float, q_block: int = 0):
    """q, k [B, T, H, Dk], v [B, T, H, Dv]; scores and softmax in fp32.

    `q_block` > 0 and < T: the queries go through in blocks of that many, each block
    rematerialised, so the fp32 scores and probabilities alive at once are [B, H, block, T]
    instead of [B, H, T, T] (8.6 GB per sequence at T = 4096 with K3's 64 heads), forward
    and backward. Every query row sees the same keys and mask either way."""
    T = q.shape[1]
    if not q_block or q_block >= T:
        return _attend(q, k, v, mask, scale)
    n = -(-T // q_block)
    pad = n * q_block - T
    qb = jnp.pad(q, ((0, 0), (0, pad), (0, 0), (0, 0))).reshape(q.shape[0], n, q_block, *q.shape[2:])
    mb = jnp.pad(mask, ((0, 0), (0, 0), (0, pad), (0, 0)), constant_values=True)
    mb = mb.reshape(*mask.shape[:2], n, q_block, mask.shape[-1])
    out = jax.lax.map(jax.checkpoint(lambda a: _attend(a[0], k, v, a[1], scale)),
                      (jnp.moveaxis(qb, 1, 0), jnp.moveaxis(mb, 2, 0)))
    return jnp.moveaxis(out, 0, 1).reshape(q.shape[0], n * q_block, *out.shape[3:])[:, :T]


def _attend(q, k, v, mask, scale: float):
    s = jnp.einsum("bqhd,bkhd->bhqk", q.astype(jnp.float32), k.astype(jnp.float32)) * scale
    s = jnp.where(mask, s, -jnp.inf)
    p = jax.nn.softmax(s, axis=-1)
    return jnp.einsum("bhqk,bkhd->bqhd", p, v.astype(jnp.float32)).astype(v.dtype)


class StackedPast(NamedTuple):
    """A scanned layer's latent cache left in its group's stack [G, B, E, S] with the
    layer's place `index`, read by each product as its own slice of the stack. Sliced
    once by the scan and read by two products (scores and the weighted sum), the layer's
    cache was copied out of the stack first on TPU, as XLA fuses a dynamic slice only into
    a single reader: twice the cache bytes of a decode step (docs/performance.md)."""
    stack: jax.Array
    index: jax.Array

    @property
    def shape(self):
        return self.stack.shape[1:]

    def take(self, width: int):
        """The layer's [B, width, S] leading features."""
        B, _, S = self.shape
        return jax.lax.dynamic_slice(self.stack, (self.index, 0, 0, 0), (1, B, width, S))[0]


def _past(past, width: int):
    return past.take(width) if isinstance(past, StackedPast) else past[..., :width, :]


def absorbed_attention(q, entries, past, lengths, kv_b, dn: int, scale: float, impl: str = "xla"):
    """Attention over the latent cache as one (kv_lora + rope)-wide MQA head.

    q [B, T, H, dn + dr]; entries [B, T, E] the new tokens' latents (E = kv_lora + dr:
    normalised c, then k_r); past [B, E, S] earlier latents (or a StackedPast), valid
    below lengths [B] (S may be 0); kv_b [kv_lora, H, dn + dv] the kv_b_proj kernel. Since
    q·k_nope = q_nope·(W_uk c) = (W_ukᵀ q_nope)·c, W_uk is folded into q and W_uv applied
    to the attention-weighted latents, so nothing per head is ever expanded per token.
    New tokens attend causally among themselves: right padding after a row's real
    tokens is never seen by them. impl 'pallas': the earlier latents go through
    k3jax.ops.latent_attention (the cache read once), joined to the new tokens' scores by
    their log-sum-exp; 'xla': one softmax over both, in products that each read the cache.
    Returns [B, T, H, dv] fp32.
    """
    f32 = jnp.float32
    r = kv_b.shape[0]
    T = q.shape[1]
    w_uk, w_uv = kv_b[..., :dn].astype(f32), kv_b[..., dn:].astype(f32)
    q = q.astype(f32)
    qf = jnp.concatenate([jnp.einsum("bthd,rhd->bthr", q[..., :dn], w_uk), q[..., dn:]], axis=-1) * scale
    new = entries.astype(f32)
    s_new = jnp.einsum("bthe,bse->bhts", qf, new)
    s_new = jnp.where(jnp.tril(jnp.ones((T, T), bool)), s_new, -jnp.inf)
    if past.shape[-1] == 0:  # a fresh prefill: no earlier tokens
        p = jax.nn.softmax(s_new, axis=-1)
        o = jnp.einsum("bhts,bsr->bthr", p, new[..., :r])
    elif impl == "pallas":
        stack, index = (past.stack, past.index) if isinstance(past, StackedPast) else (past[None], 0)
        o_old, lse_old = latent_attention.attend_past(qf, stack, index, lengths, r)
        lse_old = jnp.moveaxis(lse_old, 1, 2)                                   # [B, H, T]
        top = jnp.maximum(lse_old, jnp.max(s_new, axis=-1))                   # finite: a token sees itself
        w_old, p_new = jnp.exp(lse_old - top), jnp.exp(s_new - top[..., None])
        den = w_old + jnp.sum(p_new, axis=-1)
        o = ((jnp.moveaxis(w_old, 1, 2)[..., None] * o_old + jnp.einsum("bhts,bsr->bthr", p_new, new[..., :r]))
             / jnp.moveaxis(den, 1, 2)[..., None])
    else:
        S = past.shape[-1]
        s_old = jnp.einsum("bthe,bes->bhts", qf, _past(past, past.shape[1]).astype(f32))
        s_old = jnp.where((jnp.arange(S)[None, :] < lengths[:, None])[:, None, None, :], s_old, -jnp.inf)
        p = jax.nn.softmax(jnp.concatenate([s_old, s_new], axis=-1), axis=-1)
        o = (jnp.einsum("bhts,brs->bthr", p[..., :S], _past(past, r).astype(f32))
             + jnp.einsum("bhts,bsr->bthr", p[..., S:], new[..., :r]))
    return jnp.einsum("bthr,rhv->bthv", o, w_uv)


class GatedMLA(nn.Module):
    """`(x, segment_ids) -> y` over whole sequences; with `cache` ({'kv': [B, E, S]} latents
    of earlier tokens, valid below `lengths` [B]) it runs the absorbed path for the new
    tokens and returns `(y, entries [B, T, E])`: the caller writes them into its buffer."""
    cfg: ModelConfig

    @nn.compact
    @jax.named_scope("mla")
    def __call__(self, x, segment_ids=None, cache=None, lengths=None):
        cfg = self.cfg
        H, dn, dr, dv = cfg.num_attention_heads, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim
        B, T, _ = x.shape
        if cfg.q_lora_rank is not None:
            q = dense(cfg, cfg.q_lora_rank, ("embed", "low_rank"), "q_a_proj")(x)
            q = RMSNorm(cfg.mla_norm_eps, "q_lora", name="q_a_layernorm")(q)
            q = dense(cfg, H * cfg.q_head_dim, ("q_lora", "heads_x_dim"), "q_b_proj")(q)
        else:
            q = dense(cfg, H * cfg.q_head_dim, ("embed", "heads_x_dim"), "q_proj")(x)
        q = q.reshape(B, T, H, cfg.q_head_dim)

        ckv = dense(cfg, cfg.kv_lora_rank + dr, ("embed", "low_rank"), "kv_a_proj_with_mqa")(x)
        # whole per token: the latent cache takes this layout, and split as a serving layout
        # splits low_rank, every decode step all-gathered the whole cache (K3: 214 MB a layer)
        ckv = constrain(ckv, ("batch", "length", None))
        c = RMSNorm(cfg.mla_norm_eps, "kv_lora", name="kv_a_layernorm")(ckv[..., :cfg.kv_lora_rank])
        k_r = ckv[..., cfg.kv_lora_rank:]

        def output(o):  # output gate and projection, shared by both paths
            o = o.reshape(B, T, H * dv)
            if cfg.mla_use_output_gate:
                o = o * jax.nn.sigmoid(dense(cfg, H * dv, ("embed", "heads_x_dim"), "g_proj")(x))
            return dense(cfg, cfg.hidden_size, ("heads_x_dim", "embed"), "o_proj")(o.astype(compute_dtype(cfg)))

        if cache is not None:
            entries = jnp.concatenate([c, k_r.astype(c.dtype)], axis=-1)
            kv_b = merged_kernel(cfg, self, "kv_b_proj").reshape(cfg.kv_lora_rank, H, dn + dv)
            o = absorbed_attention(q, entries, cache["kv"], lengths, kv_b, dn, cfg.q_head_dim ** -0.5,
                                   latent_attention.impl(cfg))
            return output(o.astype(compute_dtype(cfg))), entries
        kv = dense(cfg, H * (dn + dv), ("kv_lora", "heads_x_dim"), "kv_b_proj")(c).reshape(B, T, H, dn + dv)
        k = jnp.concatenate([kv[..., :dn], jnp.broadcast_to(k_r[:, :, None, :], (B, T, H, dr))], axis=-1)
        o = softmax_attention(q, k, kv[..., dn:], attention_mask(T, segment_ids), cfg.q_head_dim ** -0.5,
                              cfg.runtime.attention_q_block)
        return output(o)
