"""The TPU layout (Mosaic; also run in interpret mode): sequential visits, megablox style.

`gmm`: grid (output-column tiles, visits, contraction tiles), the contraction innermost.
Each visit multiplies its row tile by its expert's weight tile into an fp32 VMEM
accumulator and, at the last contraction tile, writes its group's rows of the output tile.
The output tile stays in VMEM while consecutive visits (the groups of a straddling tile)
fill their rows: the first one clears the rest, the later ones keep them; visits of the
rows past Σ sizes (group E) write only those zeros.

`tgmm`: grid (contraction-row tiles, output-column tiles, visits), visits innermost. A
visit adds its group's rows of xᵀ·dy into the accumulator (rows of other groups masked to
zero); the group's last visit writes its expert's gradient tile. Every expert has a visit
(visits(every_group=True)): an empty one writes zeros. The visits past the end
load the last expert's tile and write nothing.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels.grouped.manual import out_struct


def _rows_inside(tile, g, bounds_ref, tm):
    rows = tile * jnp.int32(tm) + jax.lax.broadcasted_iota(jnp.int32, (tm, 1), 0)
    return (rows >= bounds_ref[g]) & (rows < bounds_ref[g + 1])


def _gmm_kernel(group_ref, tile_ref, weight_ref, bounds_ref, xtile_ref, x_ref, w_ref, o_ref, acc_ref, *,
                n_real, tm, dims, matmul):
    del weight_ref, xtile_ref
    i, k = pl.program_id(1), pl.program_id(2)
    prev = jnp.maximum(i - 1, 0)
    g = group_ref[i]
    first = (i == 0) | (tile_ref[prev] != tile_ref[i])

    @pl.when(k == 0)
    def _():
        acc_ref[...] = jnp.zeros(acc_ref.shape, acc_ref.dtype)

    @pl.when(g < n_real)
    def _():
        acc_ref[...] += matmul(x_ref[...], w_ref[...], dims)

    @pl.when(k == pl.num_programs(2) - 1)
    def _():
        old = jnp.where(first, jnp.zeros(o_ref.shape, o_ref.dtype), o_ref[...])
        inside = _rows_inside(tile_ref[i], g, bounds_ref, tm) & (g < n_real)
        o_ref[...] = jnp.where(inside, acc_ref[...].astype(o_ref.dtype), old)


def _tgmm_kernel(group_ref, tile_ref, weight_ref, bounds_ref, x_ref, dy_ref, o_ref, acc_ref, *,
                 n_real, tm, matmul):
    del weight_ref
    i = pl.program_id(2)
    last = pl.num_programs(2) - 1
    g = group_ref[i]
    starts = (i == 0) | (group_ref[jnp.maximum(i - 1, 0)] != g)
    ends = (i == last) | (group_ref[jnp.minimum(i + 1, last)] != g)

    @pl.when(starts)
    def _():
        acc_ref[...] = jnp.zeros(acc_ref.shape, acc_ref.dtype)

    @pl.when(g < n_real)
    def _():
        # Both sides masked: a row of another group (or past Σ sizes, where the MoE's
        # buffers hold whatever) may carry inf or NaN, and 0 · NaN is NaN.
        inside = _rows_inside(tile_ref[i], g, bounds_ref, tm)
        x = jnp.where(inside, x_ref[...], jnp.zeros(x_ref.shape, x_ref.dtype))
        dy = jnp.where(inside, dy_ref[...], jnp.zeros(dy_ref.shape, dy_ref.dtype))
        acc_ref[...] += matmul(x, dy, ((0,), (0,)))

    @pl.when(ends & (g < n_real))
    def _():
        o_ref[...] = acc_ref[...].astype(o_ref.dtype)


def _params(mode, semantics, vmem_bytes, cost):
    extra = {} if cost is None else dict(cost_estimate=cost)
    if mode == "interpret":
        return dict(interpret=True, **extra)
    return dict(compiler_params=pltpu.CompilerParams(dimension_semantics=semantics,
                                                     vmem_limit_bytes=vmem_bytes), **extra)


def gmm(vis, x, w, *, transpose_rhs, tm, tk, tn, out_dtype, mode, matmul, axes, vmem_bytes, cost):
    """[M_pad, N] = rows of x [M_pad, K] times their group's w [E, K, N] (w [E, N, K] with
    transpose_rhs)."""
    M_pad, K = x.shape
    E = w.shape[0]
    N = w.shape[1] if transpose_rhs else w.shape[2]
    if transpose_rhs:
        w_spec = pl.BlockSpec((None, tn, tk), lambda j, i, k, g, t, wt, b, xt: (wt[i], j, k))
        dims = ((1,), (1,))
    else:
        w_spec = pl.BlockSpec((None, tk, tn), lambda j, i, k, g, t, wt, b, xt: (wt[i], k, j))
        dims = ((1,), (0,))
    # The visits of rows past Σ sizes read no x: they keep the last real tile's block, so
    # the pipeline fetches nothing for them (the `ep` buffer's dropless tail is most rows).
    x_tile = jnp.where(vis.group < E, vis.tile, jnp.maximum(jax.lax.cummax(
        jnp.where(vis.group < E, vis.tile, -1)), 0)).astype(jnp.int32)
    spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=5,
        grid=(N // tn, vis.group.shape[0], K // tk),
        in_specs=[pl.BlockSpec((tm, tk), lambda j, i, k, g, t, wt, b, xt: (xt[i], k)), w_spec],
        out_specs=pl.BlockSpec((tm, tn), lambda j, i, k, g, t, wt, b, xt: (t[i], j)),
        scratch_shapes=[pltpu.VMEM((tm, tn), jnp.float32)],
    )
    kernel = functools.partial(_gmm_kernel, n_real=E, tm=tm, dims=dims, matmul=matmul)
    # Column tiles are independent (megacore may split them); visits run in order.
    return pl.pallas_call(kernel, grid_spec=spec, name="gmm_nt" if transpose_rhs else "gmm",
                          out_shape=out_struct((M_pad, N), out_dtype, axes),
                          **_params(mode, ("parallel", "arbitrary", "arbitrary"), vmem_bytes, cost),
                          )(*vis, x_tile, x, w)


def tgmm(vis, x, dy, n_groups, *, tm, tk, tn, out_dtype, mode, matmul, axes, vmem_bytes, cost):
    """[E, K, N]: for each group e, Σ over its rows of x_rᵀ dy_r (x [M_pad, K], dy [M_pad, N])."""
    K, N = x.shape[1], dy.shape[1]
    spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=4,
        grid=(K // tk, N // tn, vis.group.shape[0]),
        in_specs=[pl.BlockSpec((tm, tk), lambda kk, j, i, g, t, wt, b: (t[i], kk)),
                  pl.BlockSpec((tm, tn), lambda kk, j, i, g, t, wt, b: (t[i], j))],
        out_specs=pl.BlockSpec((None, tk, tn), lambda kk, j, i, g, t, wt, b: (wt[i], kk, j)),
        scratch_shapes=[pltpu.VMEM((tk, tn), jnp.float32)],
    )
    kernel = functools.partial(_tgmm_kernel, n_real=n_groups, tm=tm, matmul=matmul)
    return pl.pallas_call(kernel, grid_spec=spec, name="tgmm",
                          out_shape=out_struct((n_groups, K, N), out_dtype, axes),
                          **_params(mode, ("parallel", "parallel", "arbitrary"), vmem_bytes, cost),
                          )(*vis, x, dy)
