"""Attention of a few query rows over a cached latent sequence, the cache read once (Pallas).

MLA's absorbed decode (k3jax.layers.mla) scores its queries against every cached latent
(E = kv_lora + rope features each) and then sums the kv_lora-wide leading part of the same latents
by the softmax weights. As two XLA products each reads the whole cache from HBM: twice the
cache bytes of a decode step. Here one pass reads each block of the cache once and keeps a
running max, denominator and weighted sum in VMEM (the online softmax of flash decoding).

`past_attention(q, cache, lengths, dv, index=, start=, length=)`:
  q [B, R, E] fp32 query rows per sequence (decode: one token's heads; already scaled);
  cache [G, B, E, S] a stack of G layers' caches (G = 1 for one layer), the layer at `index`,
    feature-major as k3jax.infer.caches stores them (positions on the minor, lane axis);
  lengths [B] valid positions per row; the call reads positions [start, start + length)
  (the whole cache by default), so a caller splitting a cache over devices gives each its
  own range: a multiple of 128 positions, starting at a multiple of it. Positions at or past
  a row's length are never read: their blocks repeat the last live block's index, which the
  pipeline does not fetch again.
Returns (o [B, R, dv] fp32, the softmax-weighted leading dv features, 0 for a row with no
valid position in range; lse [B, R] fp32, log Σ exp(score), -inf for such a row), which
a caller merges with other ranges or with the new tokens' own scores.

Mosaic on TPU; interpret mode elsewhere (how CPU tests check it). GPUs keep XLA's two
products (k3jax.layers.mla): no Triton form here.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels.grouped.manual import out_struct, vary_together
from pallas_kernels.grouped.matmul import matmul_for

MODES = ("auto", "interpret", "tpu")
_LANES = 128          # the running max and denominator are kept lane-wide, as Mosaic stores them


def _block(n: int, prefer: tuple[int, ...]) -> int:
    """The largest preferred block dividing n, else n whole (Mosaic takes a block dim that
    divides evenly or is the whole array dim)."""
    return next((t for t in prefer if n % t == 0), n)


def _kernel(index_ref, lengths_ref, start_ref, q_ref, c_ref, o_ref, lse_ref, m_sc, l_sc, acc_sc, *,
            ts, dv, matmul):
    del index_ref
    b, s = pl.program_id(0), pl.program_id(2)
    n = lengths_ref[b]
    first = start_ref[0] + s * ts

    @pl.when(s == 0)
    def _():
        m_sc[...] = jnp.full(m_sc.shape, -jnp.inf, jnp.float32)
        l_sc[...] = jnp.zeros(l_sc.shape, jnp.float32)
        acc_sc[...] = jnp.zeros(acc_sc.shape, jnp.float32)

    @pl.when(first < n)
    def _():
        c = c_ref[...].astype(jnp.float32)                                   # [E, ts]
        sc = matmul(q_ref[...], c, ((1,), (0,)))                             # [tr, ts]
        pos = first + jax.lax.broadcasted_iota(jnp.int32, sc.shape, 1)
        sc = jnp.where(pos < n, sc, -jnp.inf)
        m_prev = m_sc[...][:, :1]
        m_new = jnp.maximum(m_prev, jnp.max(sc, axis=1, keepdims=True))     # finite: one position is live
        alpha = jnp.exp(m_prev - m_new)
        p = jnp.exp(sc - m_new)
        l_new = alpha * l_sc[...][:, :1] + jnp.sum(p, axis=1, keepdims=True)
        acc_sc[...] = alpha * acc_sc[...] + matmul(p, c[:dv], ((1,), (1,)))
        m_sc[...] = jnp.broadcast_to(m_new, m_sc.shape)
        l_sc[...] = jnp.broadcast_to(l_new, l_sc.shape)

    @pl.when(s == pl.num_programs(2) - 1)
    def _():
        l = l_sc[...][:, :1]
        seen = l > 0
        o_ref[...] = jnp.where(seen, acc_sc[...] / jnp.where(seen, l, 1.0), 0.0)
        lse = jnp.where(seen, m_sc[...][:, :1] + jnp.log(jnp.where(seen, l, 1.0)), -jnp.inf)
        lse_ref[...] = jnp.broadcast_to(lse, lse_ref.shape)


def past_attention(q, cache, lengths, dv: int, *, index=0, start=0, length=None, mode="auto"):
    """See the module doc. `length`: positions read from `start` (static; S - start by default)."""
    if mode not in MODES:
        raise ValueError(f"past_attention: unknown mode {mode!r}; expected one of {MODES}")
    if cache.ndim != 4 or q.ndim != 3 or q.shape[::2] != cache.shape[1:3]:
        raise ValueError(f"past_attention: q [B, R, E] and cache [G, B, E, S] must agree, got "
                         f"{q.shape} and {cache.shape}")
    length = cache.shape[3] if length is None else length
    if length != cache.shape[3] and length % 128:
        raise ValueError(f"past_attention: a range of {length} positions, not the whole cache, must be "
                         "a multiple of 128 (the kernel's blocks of the position axis)")
    run = functools.partial(_run, dv=dv, length=length)
    args = (q.astype(jnp.float32), cache, jnp.asarray(lengths, jnp.int32),
            jnp.asarray(index, jnp.int32).reshape(1), jnp.asarray(start, jnp.int32).reshape(1))
    if mode != "auto":
        return run(*args, mode=mode)
    return jax.lax.platform_dependent(*args, tpu=functools.partial(run, mode="tpu"),
                                      default=functools.partial(run, mode="interpret"))


def _run(q, cache, lengths, index, start, *, dv, length, mode):
    B, R, E = q.shape
    ts = _block(length, (512, 256, 128))
    R_pad = -(-R // 8) * 8
    tr = R_pad if R_pad <= 256 else 256
    R_pad = -(-R_pad // tr) * tr
    q = jnp.pad(q, ((0, 0), (0, R_pad - R), (0, 0)))
    (q, cache, lengths, index, start), axes = vary_together(q, cache, lengths, index, start)

    def cache_block(b, r, s, index_ref, lengths_ref, start_ref):
        # past the row's length: the last live block again, which the pipeline does not refetch
        # (lax.div: both are >= 0, and floor division's sign fix-up has no Mosaic lowering on every chip)
        live = jnp.maximum(lengths_ref[b] - start_ref[0], 1)
        return index_ref[0], b, 0, jax.lax.div(start_ref[0], ts) + jnp.minimum(s, jax.lax.div(live - 1, ts))

    spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=3,
        grid=(B, R_pad // tr, length // ts),
        in_specs=[pl.BlockSpec((None, tr, E), lambda b, r, s, *_: (b, r, 0)),
                  pl.BlockSpec((None, None, E, ts), cache_block)],
        out_specs=[pl.BlockSpec((None, tr, dv), lambda b, r, s, *_: (b, r, 0)),
                   pl.BlockSpec((None, tr, _LANES), lambda b, r, s, *_: (b, r, 0))],
        scratch_shapes=[pltpu.VMEM((tr, _LANES), jnp.float32), pltpu.VMEM((tr, _LANES), jnp.float32),
                        pltpu.VMEM((tr, dv), jnp.float32)],
    )
    c = cache.dtype.itemsize
    cost = pl.CostEstimate(
        flops=int(2 * B * R_pad * length * (E + dv)), transcendentals=int(B * R_pad * length),
        bytes_accessed=int(B * (length * E * c + R_pad * (E + dv + _LANES) * 4) * (R_pad // tr)))
    kernel = functools.partial(_kernel, ts=ts, dv=dv, matmul=matmul_for(mode, jnp.float32))
    extra = dict(interpret=True) if mode == "interpret" else dict(compiler_params=pltpu.CompilerParams(
        dimension_semantics=("parallel", "parallel", "arbitrary")))
    o, lse = pl.pallas_call(
        kernel, grid_spec=spec, name="latent_past_attention", cost_estimate=cost,
        out_shape=[out_struct((B, R_pad, dv), jnp.float32, axes),
                   out_struct((B, R_pad, _LANES), jnp.float32, axes)], **extra,
    )(index, lengths, start, q, cache)
    return o[:, :R], lse[:, :R, 0]
