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



def attn_res_mix(stack, count, p, norm_w, proj_w, eps: float, pending=None, has_pending=None):
    """h = Σ_s softmax_s(score_s) V_s over V = [stack[:count], pending?, p].

    score_s = Σ_d (norm_w ⊙ proj_w)_d · RMSNorm(V_s)_d; keys normalised, values raw, fp32.
    Slots at or past `count` are masked out, and so is `pending` (a block pushed but not yet
    written into the stack, `defer_block`) unless `has_pending`; it joins the stack's
    fp32 copy that the scores are taken from anyway.
    """
    if stack is None or stack.shape[0] == 0:
        return p
    w = norm_w.astype(jnp.float32) * proj_w.astype(jnp.float32)
    pf = p.astype(jnp.float32)
    s_p = jnp.einsum("btd,d->bt", rms_normalize(pf, eps), w, precision=HIGHEST)
    if pending is not None:   # the pending block as one more stack slot, valid or not
        stack = jnp.concatenate([stack, pending[None].astype(stack.dtype)])
        count_valid = (jnp.arange(stack.shape[0]) < count) | (
            (jnp.arange(stack.shape[0]) == stack.shape[0] - 1) & has_pending)
        return _mix(stack, count_valid, pf, s_p, w, eps).astype(p.dtype)
    return _mix(stack, jnp.arange(stack.shape[0]) < count, pf, s_p, w, eps).astype(p.dtype)


def _mix(stack, slot_valid, pf, s_p, w, eps):
    """The softmax over the valid stack slots and p (see `attn_res_mix`), fp32."""
    valid = slot_valid[:, None, None]
    # zero the unused slots too: a weight of 0 times a NaN left in a slot is still NaN
    sf = jnp.where(valid[..., None], stack.astype(jnp.float32), 0.0)
    s_stack = jnp.einsum("nbtd,d->nbt", rms_normalize(sf, eps), w, precision=HIGHEST)
    s_stack = jnp.where(valid, s_stack, -jnp.inf)
    m = jnp.maximum(jnp.max(s_stack, axis=0), s_p)
    e_stack = jnp.where(valid, jnp.exp(s_stack - m), 0.0)
    e_p = jnp.exp(s_p - m)
    z = jnp.sum(e_stack, axis=0) + e_p
    return jnp.einsum("nbt,nbtd->btd", e_stack / z, sf, precision=HIGHEST) + (e_p / z)[..., None] * pf


class AttnRes(nn.Module):
    """One mixing site: a pseudo-query `proj` and a key norm `norm` (checkpoint names
    `{site}_res_proj` / `{site}_res_norm`). Zero pseudo-queries give uniform weights."""
    eps: float

    @nn.compact
    @jax.named_scope("attn_res")
    def __call__(self, stack, count, p, pending=None, has_pending=None):
        d = p.shape[-1]
        norm_w = self.param("norm", logical(nn.initializers.ones, ("embed",)), (d,), jnp.float32)
        proj_w = self.param("proj", logical(nn.initializers.zeros, ("embed",)), (d,), jnp.float32)
        return attn_res_mix(stack, count, p, norm_w, proj_w, self.eps, pending, has_pending)


def defer_block(p, push):
    """A push held back (pending, has_pending, p): the block p becomes a pending source for
    the rest of the group and is written into the stack by `flush_block` at the group's
    end. The group's layers then all read the stack they got, so under remat they save
    one stack between them instead of a copy after the push."""
    return jnp.where(push, p, jnp.zeros_like(p)), jnp.asarray(push), jnp.where(push, jnp.zeros_like(p), p)


def flush_block(stack, count, pending, has_pending):
    """Write a pending block into the stack: (stack, count)."""
    stack, count, _ = push_block(stack, count, pending, has_pending)
    return stack, count


def push_block(stack, count, p, push):
    """Freeze p onto the stack where `push` holds (static bool or traced scalar)."""
    slot = jnp.minimum(count, stack.shape[0] - 1)
    entry = jnp.where(push, p.astype(stack.dtype), jax.lax.dynamic_index_in_dim(stack, slot, 0, keepdims=False))
    stack = jax.lax.dynamic_update_index_in_dim(stack, entry, slot, 0)
    return stack, count + jnp.asarray(push, count.dtype), jnp.where(push, jnp.zeros_like(p), p)
