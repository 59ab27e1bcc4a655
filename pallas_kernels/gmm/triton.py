"""The GPU layout (Triton; also run in interpret mode): every program independent.

`gmm`: one program per (visit, output-column tile), visits on the grid's first axis (the
one CUDA allows 2**31 - 1 blocks on). It loops over the contraction in chunks and stores
only its group's rows: visits of a straddling tile write disjoint rows, and the visits of
group E (rows past Σ sizes) run no chunk and store zeros.

`tgmm`: one program per (expert, contraction-row tile, output-column tile), looping over
its expert's rows in chunks of tm: an expert without rows stores zeros. Programs of
experts with many rows run longer; the grid has E times the tiles of one weight, so the
GPU stays busy while they do.

Refs are whole arrays, loads and stores masked past each array's end (no dimension needs
to be a multiple of a tile); the visit list is an ordinary input (Pallas's Triton lowering
has no scalar prefetch). Block sizes are powers of two, every dot dimension >= 16.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from pallas_kernels.grouped.manual import out_struct


def _iota(n):
    return jax.lax.broadcasted_iota(jnp.int32, (n,), 0)


def _load(ref, r0, rows, c0, cols, row_ok=None, lead=()):
    """ref[*lead, r0:r0+rows, c0:c0+cols], zero past its end and where row_ok is false (one
    indexer: Pallas's Triton lowering takes no chained `.at`)."""
    R, C = ref.shape[-2:]
    ok = (r0 + _iota(rows) < R)[:, None] & (c0 + _iota(cols) < C)[None, :]
    if row_ok is not None:
        ok = ok & row_ok[:, None]
    return pltriton.load(ref.at[(*lead, pl.ds(r0, rows), pl.ds(c0, cols))], mask=ok, other=0)


def _gmm_kernel(group_ref, tile_ref, weight_ref, bounds_ref, x_ref, w_ref, o_ref, *,
                n_real, tm, tn, tk, transpose_rhs, matmul):
    i = pl.program_id(0)
    g, t, e = group_ref[i], tile_ref[i], weight_ref[i]
    r0 = t * tm
    rows = r0 + _iota(tm)
    inside = (rows >= bounds_ref[g]) & (rows < bounds_ref[g + 1])
    K = x_ref.shape[1]
    n0 = pl.program_id(1) * tn

    def chunk(c, acc):
        k0 = c * tk
        x = _load(x_ref, r0, tm, k0, tk)
        if transpose_rhs:
            return acc + matmul(x, _load(w_ref, n0, tn, k0, tk, lead=(e,)), ((1,), (1,)))
        return acc + matmul(x, _load(w_ref, k0, tk, n0, tn, lead=(e,)), ((1,), (0,)))

    steps = jnp.where(g < n_real, jnp.int32(pl.cdiv(K, tk)), jnp.int32(0))
    acc = jax.lax.fori_loop(0, steps, chunk, jnp.zeros((tm, tn), jnp.float32))
    cols_ok = (n0 + _iota(tn) < o_ref.shape[1])[None, :]
    pltriton.store(o_ref.at[pl.ds(r0, tm), pl.ds(n0, tn)], acc.astype(o_ref.dtype),
                   mask=inside[:, None] & cols_ok)


def _tgmm_kernel(bounds_ref, x_ref, dy_ref, o_ref, *, tm, tk, tn, matmul):
    e = pl.program_id(0)
    k0, n0 = pl.program_id(1) * tk, pl.program_id(2) * tn
    start, end = bounds_ref[e], bounds_ref[e + 1]

    def chunk(c, acc):
        r0 = start + c * tm
        row_ok = r0 + _iota(tm) < end
        x = _load(x_ref, r0, tm, k0, tk, row_ok)   # both masked: 0 · NaN is NaN
        dy = _load(dy_ref, r0, tm, n0, tn, row_ok)
        return acc + matmul(x.T, dy, ((1,), (0,)))

    acc = jax.lax.fori_loop(0, pl.cdiv(end - start, tm), chunk, jnp.zeros((tk, tn), jnp.float32))
    K, N = o_ref.shape[1:]
    ok = (k0 + _iota(tk) < K)[:, None] & (n0 + _iota(tn) < N)[None, :]
    pltriton.store(o_ref.at[e, pl.ds(k0, tk), pl.ds(n0, tn)], acc.astype(o_ref.dtype), mask=ok)


def _whole(a):
    return pl.BlockSpec(a.shape, lambda *_: (0,) * a.ndim)


def _params(mode, num_warps, cost):
    extra = {} if cost is None else dict(cost_estimate=cost)
    if mode == "interpret":
        return dict(interpret=True, **extra)
    return dict(compiler_params=pltriton.CompilerParams(num_warps=num_warps, num_stages=2), **extra)


def gmm(vis, x, w, *, transpose_rhs, tm, tk, tn, out_dtype, mode, matmul, axes, cost, num_warps=4):
    """[M_pad, N] = rows of x [M_pad, K] times their group's w [E, K, N] ([E, N, K] with
    transpose_rhs)."""
    N = w.shape[1] if transpose_rhs else w.shape[2]
    args = (*vis, x, w)
    kernel = functools.partial(_gmm_kernel, n_real=w.shape[0], tm=tm, tn=tn, tk=tk,
                               transpose_rhs=transpose_rhs, matmul=matmul)
    shape = out_struct((x.shape[0], N), out_dtype, axes)
    return pl.pallas_call(
        kernel, grid=(vis.group.shape[0], pl.cdiv(N, tn)), in_specs=[_whole(a) for a in args],
        out_specs=_whole(shape), out_shape=shape, name="gmm_nt" if transpose_rhs else "gmm",
        **_params(mode, num_warps, cost))(*args)


def tgmm(bounds, x, dy, n_groups, *, tm, tk, tn, out_dtype, mode, matmul, axes, cost, num_warps=4):
    """[E, K, N]: for each group e, Σ over its rows (bounds[e]..bounds[e+1]) of x_rᵀ dy_r."""
    K, N = x.shape[1], dy.shape[1]
    args = (bounds, x, dy)
    kernel = functools.partial(_tgmm_kernel, tm=tm, tk=tk, tn=tn, matmul=matmul)
    shape = out_struct((n_groups, K, N), out_dtype, axes)
    return pl.pallas_call(
        kernel, grid=(n_groups, pl.cdiv(K, tk), pl.cdiv(N, tn)), in_specs=[_whole(a) for a in args],
        out_specs=_whole(shape), out_shape=shape, name="tgmm",
        **_params(mode, num_warps, cost))(*args)
