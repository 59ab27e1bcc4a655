"""Block Attention Residuals: a softmax over depth, per token (SPEC.md §2).

The stack of frozen block representations is a fixed-size buffer [N, B, T, D] with a
count, so the same code runs unrolled and inside `nn.scan` (where the count is traced).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import linen as nn

from k3jax.layers.common import HIGHEST, logical
from k3jax.layers.norms import rms_normalize



def attn_res_mix(stack, count, p, norm_w, proj_w, eps: float):
    """h = Σ_s softmax_s(score_s) V_s over V = [stack[:count], p].

    score_s = Σ_d (norm_w ⊙ proj_w)_d · RMSNorm(V_s)_d; keys normalised, values raw, fp32.
    Slots at or past `count` are masked out. Stack and p are scored separately so the
    buffer is never copied into a concatenation.
    """
    if stack is None or stack.shape[0] == 0:
        return p
    w = norm_w.astype(jnp.float32) * proj_w.astype(jnp.float32)
    pf = p.astype(jnp.float32)
    s_p = jnp.einsum("btd,d->bt", rms_normalize(pf, eps), w, precision=HIGHEST)
    valid = (jnp.arange(stack.shape[0]) < count)[:, None, None]
    # zero the unused slots too: a weight of 0 times a NaN left in a slot is still NaN
    sf = jnp.where(valid[..., None], stack.astype(jnp.float32), 0.0)
    s_stack = jnp.einsum("nbtd,d->nbt", rms_normalize(sf, eps), w, precision=HIGHEST)
    s_stack = jnp.where(valid, s_stack, -jnp.inf)
    m = jnp.maximum(jnp.max(s_stack, axis=0), s_p)
    e_stack = jnp.where(valid, jnp.exp(s_stack - m), 0.0)
    e_p = jnp.exp(s_p - m)
    z = jnp.sum(e_stack, axis=0) + e_p
    h = jnp.einsum("nbt,nbtd->btd", e_stack / z, sf, precision=HIGHEST) + (e_p / z)[..., None] * pf
    return h.astype(p.dtype)


class AttnRes(nn.Module):
    """One mixing site: a pseudo-query `proj` and a key norm `norm` (checkpoint names
    `{site}_res_proj` / `{site}_res_norm`). Zero pseudo-queries give uniform weights."""
    eps: float

    @nn.compact
    def __call__(self, stack, count, p):
        d = p.shape[-1]
        norm_w = self.param("norm", logical(nn.initializers.ones, ("embed",)), (d,), jnp.float32)
        proj_w = self.param("proj", logical(nn.initializers.zeros, ("embed",)), (d,), jnp.float32)
        return attn_res_mix(stack, count, p, norm_w, proj_w, self.eps)


def push_block(stack, count, p, push):
    """Freeze p onto the stack where `push` holds (static bool or traced scalar)."""
    slot = jnp.minimum(count, stack.shape[0] - 1)
    entry = jnp.where(push, p.astype(stack.dtype), jax.lax.dynamic_index_in_dim(stack, slot, 0, keepdims=False))
    stack = jax.lax.dynamic_update_index_in_dim(stack, entry, slot, 0)
    return stack, count + jnp.asarray(push, count.dtype), jnp.where(push, jnp.zeros_like(p), p)
