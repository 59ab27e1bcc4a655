"""Kimi Delta Attention layer (SPEC.md §3): projections, short convolutions, gates.

The recurrence itself lives in `k3jax.ops.kda`; this module turns hidden states into its
arguments and its output back into hidden states.
"""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from flax import linen as nn

from k3jax.config import ModelConfig
from k3jax.layers.common import compute_dtype, dense, logical
from k3jax.layers.norms import GatedRMSNorm
from k3jax.ops import kda as kda_ops
from k3jax.ops.kda_context import sharded_kda
from k3jax.mesh import active_mesh_axes, fit_spec


def l2_normalize(x, eps: float):
    x = x.astype(jnp.float32)
    return x * jax.lax.rsqrt(jnp.sum(jnp.square(x), axis=-1, keepdims=True) + eps)


def causal_conv_silu(x, kernel, segment_ids=None, tail=None):
    """SiLU(depthwise causal conv) over time; fp32 math.

    x [B, T, C]; kernel [W, C] (tap W-1 multiplies the current token); tail [B, W-1, C]
    holds the previous inputs when continuing a sequence. A tap never reaches across a
    document boundary: packed documents see zeros before their first token, exactly as
    if run alone. Returns (y, new_tail) with new_tail the last W-1 inputs.
    """
    W = kernel.shape[0]
    B, T, C = x.shape
    # a carried tail continues the document of the first token; without one, the taps
    # before t=0 see padding that matches no document
    before = -1 if tail is None or segment_ids is None else segment_ids[:, :1]
    if tail is None:
        tail = jnp.zeros((B, W - 1, C), x.dtype)
    xe = jnp.concatenate([tail.astype(x.dtype), x], axis=1).astype(jnp.float32)
    kf = kernel.astype(jnp.float32)
    y = jnp.zeros((B, T, C), jnp.float32)
    for j in range(W):  # W is 4: a static handful of shifted multiply-adds
        shift = W - 1 - j
        tap = xe[:, j:j + T] * kf[j]
        if segment_ids is not None and shift:
            prev = jnp.concatenate([jnp.broadcast_to(before, (B, shift)).astype(segment_ids.dtype),
                                    segment_ids], axis=1)[:, :T]
            tap = jnp.where((prev == segment_ids)[..., None], tap, 0.0)
        y = y + tap
    return jax.nn.silu(y), xe[:, T:].astype(x.dtype)


def forget_gate(cfg: ModelConfig, f, A_log, dt_bias):
    """Per head and key channel log-decay g ≤ 0, fp32. f [..., H, K]."""
    H, K = f.shape[-2:]
    x = f.astype(jnp.float32) + dt_bias.astype(jnp.float32).reshape(H, K)
    a = jnp.exp(A_log.astype(jnp.float32))[:, None]
    if cfg.gate_lower_bound is not None:  # K3's "safe" gate: g ∈ (lb, 0)
        return cfg.gate_lower_bound * jax.nn.sigmoid(a * x)
    return -a * jax.nn.softplus(x)


def kda_sequence(cfg: ModelConfig, q, k, v, g, beta, segment_ids=None, state=None):
    """The recurrence over whole sequences with the configured impl: (o, outgoing state),
    the state only when an incoming one is given (a cache's).

    Under a mesh each device runs its own slice of batch and heads (ops.kda_context.
    sharded_kda): left to XLA's partitioner, every device gathered and computed the whole
    global batch. Where the rules shard `length` too (context parallelism), its slices
    are consecutive pieces of time and only the fixed-size state maps cross devices."""
    kw = dict(segment_ids=segment_ids, initial_state=state, output_final_state=state is not None,
              impl=cfg.runtime.kda_impl, chunk_size=cfg.runtime.kda_chunk_size,
              gate_lower_bound=cfg.gate_lower_bound)
    if not active_mesh_axes(("batch", "length", "heads")):
        return kda_ops.kda(q, k, v, g, beta, **kw)
    sizes = dict(jax.sharding.get_abstract_mesh().shape)
    spec = fit_spec(q.shape[:3], nn.logical_to_mesh_axes(("batch", "length", "heads")), sizes)
    return sharded_kda(q, k, v, g, beta, spec=spec, **kw)


def _a_log_init(key, shape, dtype):
    return jnp.log(jax.random.uniform(key, shape, dtype, 1.0, 16.0))


def _dt_bias_init(key, shape, dtype):
    # softplus^-1 of dt ~ logU(1e-3, 1e-1): the usual state-space timescale spread.
    dt = jnp.exp(jax.random.uniform(key, shape, dtype, math.log(1e-3), math.log(1e-1)))
    return dt + jnp.log(-jnp.expm1(-dt))


def _tail_at(tail, p, n_new):
    """The last W-1 conv inputs before each row's first unused position: rows of
    [tail, p] at n_new[b] .. n_new[b]+W-2, so right padding never enters the tail."""
    xe = jnp.concatenate([tail.astype(p.dtype), p], axis=1)
    idx = n_new[:, None] + jnp.arange(tail.shape[1])[None, :]
    return jnp.take_along_axis(xe, idx[..., None], axis=1)


class KimiDeltaAttention(nn.Module):
    """`(x, segment_ids) -> y` over whole sequences; with `cache` (conv tails `q_conv`,
    `k_conv`, `v_conv` [B, W-1, H*K] and `state` [B, H, K, V] fp32) and `n_new` [B] (real
    tokens per row, the rest right padding) it continues those sequences and returns
    `(y, new_cache)`. Padding gets g = 0 and β = 0: the state neither decays nor updates
    there, so the final state is each row's state at its own last real token."""
    cfg: ModelConfig

    @nn.compact
    @jax.named_scope("kda")     # a profile's stages read by name (also "mla", "moe_*", "attn_res")
    def __call__(self, x, segment_ids=None, cache=None, n_new=None):
        cfg = self.cfg
        H, K, W = cfg.kda_num_heads, cfg.kda_head_dim, cfg.short_conv_kernel_size
        B, T, _ = x.shape
        proj = H * K
        new_cache = {}

        def conv_branch(name):
            p = dense(cfg, proj, ("embed", "heads_x_dim"), f"{name}_proj")(x)
            kernel = self.param(f"{name}_conv1d", logical(
                nn.initializers.normal(1.0 / math.sqrt(W)), ("conv", "heads_x_dim")), (W, proj), jnp.float32)
            tail = None if cache is None else cache[f"{name}_conv"]
            y, _ = causal_conv_silu(p, kernel, segment_ids, tail)
            if cache is not None:
                new_cache[f"{name}_conv"] = _tail_at(tail, p, n_new).astype(tail.dtype)
            return y.reshape(B, T, H, K)

        q = l2_normalize(conv_branch("q"), cfg.kda_qk_l2_eps)
        k = l2_normalize(conv_branch("k"), cfg.kda_qk_l2_eps)
        v = conv_branch("v").astype(compute_dtype(cfg))

        A_log = self.param("A_log", logical(_a_log_init, ("heads",)), (H,), jnp.float32)
        dt_bias = self.param("dt_bias", logical(_dt_bias_init, ("heads_x_dim",)), (proj,), jnp.float32)
        f = dense(cfg, K, ("embed", "low_rank"), "f_a_proj")(x)
        f = dense(cfg, proj, ("kda_rank", "heads_x_dim"), "f_b_proj")(f).reshape(B, T, H, K)
        g = forget_gate(cfg, f, A_log, dt_bias)
        beta = jax.nn.sigmoid(dense(cfg, H, ("embed", "heads"), "b_proj")(x).astype(jnp.float32))

        if cache is None:
            o, _ = kda_sequence(cfg, q, k, v, g, beta, segment_ids)
        else:
            valid = jnp.arange(T)[None, :] < n_new[:, None]
            g = jnp.where(valid[..., None, None], g, 0.0)
            beta = jnp.where(valid[..., None], beta, 0.0)
            if T == 1:  # decode: the one-token update, no chunk machinery
                o, state = kda_ops.kda_step(q[:, 0], k[:, 0], v[:, 0], g[:, 0], beta[:, 0], cache["state"])
                o = o[:, None]
            else:
                o, state = kda_sequence(cfg, q, k, v, g, beta, state=cache["state"])
            new_cache["state"] = state

        if cfg.use_full_rank_gate:
            gate = dense(cfg, proj, ("embed", "heads_x_dim"), "g_proj")(x)
        else:
            gate = dense(cfg, K, ("embed", "low_rank"), "g_a_proj")(x)
            gate = dense(cfg, proj, ("kda_rank", "heads_x_dim"), "g_b_proj")(gate)
        o = GatedRMSNorm(cfg.rms_norm_eps, name="o_norm")(o, gate.reshape(B, T, H, K))
        o = o.reshape(B, T, proj).astype(compute_dtype(cfg))
        y = dense(cfg, cfg.hidden_size, ("heads_x_dim", "embed"), "o_proj")(o)
        return y if cache is None else (y, new_cache)
