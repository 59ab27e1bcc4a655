"""The TPU layout (Mosaic; also run in interpret mode): a sequential visit axis with the
decoded weight tile cached in VMEM.

Grid (weight-column tiles, visits), the visit axis innermost and in order. Scalar prefetch
carries the visit list (pallas_kernels.grouped.visits.Visits), so each visit's BlockSpecs fetch its row tile of
x and its expert's packed/scale tile. The tile is decoded into a VMEM scratch on the
first visit of each (expert, column tile) and reused by the expert's later row tiles, so
decoding costs once per expert and tile however many rows the expert has. An output tile
stays in VMEM while consecutive visits (the groups of a straddling tile) fill their rows:
the first one clears the rest, the later ones keep them.

`nt` computes x @ Wᵀ: the contraction K is whole in each block (x's even and odd columns
against the low and high nibbles; scales expanded 16-fold along lanes). `nn` computes
x @ W: the contraction N is whole, the output tiled over packed columns, and the scales
arrive k-tile-major ([E, K/2/tkh, N, tkh/16], transposed by the caller: a Mosaic block's
last dim must be a multiple of 128 lanes or the whole dim, which tkh/16 is not).
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels.mxfp4_gmm import encode
from pallas_kernels.mxfp4_gmm.decode import e2m1_e8m0, nibbles
from pallas_kernels.grouped.manual import out_struct

SCALE_LANES = 16  # packed bytes per E8M0 scale (32 values)
# The decoded tile is cached in bf16 whatever the compute dtype: every MXFP4 value has at
# most two significant bits, so bf16 holds it exactly, in half the VMEM of fp32 (an fp32
# cache did not fit v4's 16 MiB for K3's w2 backward).
CACHE_DTYPE = jnp.bfloat16


def _expand(s, rows, cols):
    """[rows, cols] scales -> [rows, 16·cols], each repeated for its 16 packed bytes."""
    return jnp.broadcast_to(s[:, :, None], (rows, cols, SCALE_LANES)).reshape(rows, cols * SCALE_LANES)


def decode_tile(p_ref, s_ref, wlo_ref, whi_ref, rc, merge=None):
    """Decode packed [R, C] / scale [R, C/16] refs into (low, high) [R, C] scratch refs,
    rc rows at a time (bounding the int32 temporaries). merge: (Bᵀ [R, r], A_lo, A_hi
    [r, C] refs, alpha/r): the tile becomes mxfp4(W + (alpha/r)·Bᵀ A), re-quantized group
    by group (a tile holds whole groups of 32 inputs), the exporter's rounding."""
    R, C = p_ref.shape

    def chunk(r, carry):
        r0 = pl.multiple_of(r * jnp.int32(rc), rc)
        lo, hi = nibbles(p_ref[pl.ds(r0, rc), :])
        s = _expand(s_ref[pl.ds(r0, rc), :].astype(jnp.int32), rc, C // SCALE_LANES)
        if merge is not None:
            bt_ref, alo_ref, ahi_ref, sc = merge
            bt = bt_ref[pl.ds(r0, rc), :]
            w_lo = encode.merge(e2m1_e8m0(lo, s), bt, alo_ref[...], sc)
            w_hi = encode.merge(e2m1_e8m0(hi, s), bt, ahi_ref[...], sc)
            s_new, lo, hi = encode.quantize_halves(w_lo, w_hi)
            s = _expand(s_new, rc, C // SCALE_LANES)
        wlo_ref[pl.ds(r0, rc), :] = e2m1_e8m0(lo, s, wlo_ref.dtype)
        whi_ref[pl.ds(r0, rc), :] = e2m1_e8m0(hi, s, whi_ref.dtype)
        return carry

    # int32 bounds and offsets: Mosaic indexes in i32, also under jax_enable_x64.
    jax.lax.fori_loop(jnp.int32(0), jnp.int32(R // rc), chunk, 0)


def _visit_state(group_ref, tile_ref, bounds_ref, tm):
    """(group, is the first visit of its weight tile, is the first visit of its row tile,
    [tm, 1] mask of the group's rows in the tile)."""
    i = pl.program_id(1)
    prev = jnp.maximum(i - 1, 0)
    g = group_ref[i]
    new_weight = (i == 0) | (group_ref[prev] != g)
    first = (i == 0) | (tile_ref[prev] != tile_ref[i])
    rows = tile_ref[i] * jnp.int32(tm) + jax.lax.broadcasted_iota(jnp.int32, (tm, 1), 0)
    inside = (rows >= bounds_ref[g]) & (rows < bounds_ref[g + 1])
    return g, new_weight, first, inside


def _write(o_ref, g, n_real, first, inside, y_fn):
    old = jnp.where(first, jnp.zeros(o_ref.shape, o_ref.dtype), o_ref[...])

    @pl.when(g < n_real)
    def _():
        o_ref[...] = jnp.where(inside, y_fn().astype(o_ref.dtype), old)

    @pl.when(g >= n_real)
    def _():
        o_ref[...] = old


def _merge(refs, scale):
    """decode_tile's merge from the refs before the output and scratch ones (Bᵀ, A_lo, A_hi
    when re-quantizing), None without."""
    return None if scale is None else (*refs, scale)


def _nt_kernel(group_ref, tile_ref, weight_ref, bounds_ref, xlo_ref, xhi_ref, p_ref, s_ref, *refs,
               n_real, tm, rc, matmul, merge_scale=None):
    del weight_ref
    *merge_refs, o_ref, wlo_ref, whi_ref = refs
    merge = _merge(merge_refs, merge_scale)
    g, new_weight, first, inside = _visit_state(group_ref, tile_ref, bounds_ref, tm)

    @pl.when((g < n_real) & new_weight)
    def _():
        decode_tile(p_ref, s_ref, wlo_ref, whi_ref, rc, merge)

    nt = ((1,), (1,))
    cdt = xlo_ref.dtype
    _write(o_ref, g, n_real, first, inside,
           lambda: matmul(xlo_ref[...], wlo_ref[...].astype(cdt), nt)
           + matmul(xhi_ref[...], whi_ref[...].astype(cdt), nt))


def _nn_kernel(group_ref, tile_ref, weight_ref, bounds_ref, x_ref, p_ref, s_ref, *refs,
               n_real, tm, rc, matmul, merge_scale=None):
    del weight_ref
    *merge_refs, olo_ref, ohi_ref, wlo_ref, whi_ref = refs
    merge = _merge(merge_refs, merge_scale)
    g, new_weight, first, inside = _visit_state(group_ref, tile_ref, bounds_ref, tm)

    @pl.when((g < n_real) & new_weight)
    def _():
        decode_tile(p_ref, s_ref, wlo_ref, whi_ref, rc, merge)

    nn = ((1,), (0,))
    cdt = x_ref.dtype
    _write(olo_ref, g, n_real, first, inside, lambda: matmul(x_ref[...], wlo_ref[...].astype(cdt), nn))
    _write(ohi_ref, g, n_real, first, inside, lambda: matmul(x_ref[...], whi_ref[...].astype(cdt), nn))


def _params(mode, vmem_bytes, cost):
    extra = {} if cost is None else dict(cost_estimate=cost)
    if mode == "interpret":
        return dict(interpret=True, **extra)
    # Column tiles are independent (megacore may split them); visits must run in order.
    return dict(compiler_params=pltpu.CompilerParams(
        dimension_semantics=("parallel", "arbitrary"), vmem_limit_bytes=vmem_bytes), **extra)


def _row_chunk(rows):
    return 32 if rows % 32 == 0 else rows  # u8 refs tile 32 rows to a vreg


def _merge_specs(merge, rows, cols, col_block):
    """(operands, BlockSpecs, scale) of a merge (A_lo, A_hi [E|1, r, K/2], Bᵀ [E, N, r],
    alpha/r): Bᵀ's rows `rows(j, w)` of the weight tile, A's columns `col_block(j)` of
    width `cols`; a shared A (leading 1) is read by every expert."""
    if merge is None:
        return (), [], None
    lo_t, hi_t, b_t, sc = merge
    r = b_t.shape[-1]
    shared = lo_t.shape[0] == 1
    a_spec = pl.BlockSpec((None, r, cols), lambda j, i, g, t, w, b: (0 if shared else w[i], 0, col_block(j)))
    b_spec = pl.BlockSpec((None, rows[0], r), lambda j, i, g, t, w, b: (w[i], rows[1](j), 0))
    return (b_t, lo_t, hi_t), [b_spec, a_spec, a_spec], float(sc)


def gmm_nt(vis, x_lo, x_hi, packed, scale, *, tm, tn, out_dtype, mode, matmul, vmem_bytes, axes, cost=None,
           merge=None):
    """y [M_pad, N] = x @ W_gᵀ from x's even/odd columns [M_pad, K/2] (compute dtype).
    merge: (A_lo, A_hi, Bᵀ, alpha/r) to re-quantize each decoded tile (decode_tile)."""
    E, N, Kh = packed.shape
    Ks = scale.shape[-1]
    M_pad = x_lo.shape[0]
    row = lambda j, i, g, t, w, b: (t[i], 0)  # noqa: E731
    wt = lambda j, i, g, t, w, b: (w[i], j, 0)  # noqa: E731
    extra, extra_specs, sc = _merge_specs(merge, (tn, lambda j: j), Kh, lambda j: 0)
    spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=4,
        grid=(pl.cdiv(N, tn), vis.group.shape[0]),
        in_specs=[pl.BlockSpec((tm, Kh), row), pl.BlockSpec((tm, Kh), row),
                  pl.BlockSpec((None, tn, Kh), wt), pl.BlockSpec((None, tn, Ks), wt), *extra_specs],
        out_specs=pl.BlockSpec((tm, tn), lambda j, i, g, t, w, b: (t[i], j)),
        scratch_shapes=[pltpu.VMEM((tn, Kh), CACHE_DTYPE), pltpu.VMEM((tn, Kh), CACHE_DTYPE)],
    )
    kernel = functools.partial(_nt_kernel, n_real=E, tm=tm, rc=_row_chunk(tn), matmul=matmul, merge_scale=sc)
    return pl.pallas_call(kernel, grid_spec=spec, name="mxfp4_gmm_nt" if merge is None else "mxfp4_qat_gmm_nt",
                          out_shape=out_struct((M_pad, N), out_dtype, axes),
                          **_params(mode, vmem_bytes, cost))(*vis, x_lo, x_hi, packed, scale, *extra)


def gmm_nn(vis, x, packed, scale_t, *, tm, tkh, out_dtype, mode, matmul, vmem_bytes, axes, cost=None,
           merge=None):
    """(y_lo, y_hi) [M_pad, K/2]: x [M_pad, N] @ W_g's even / odd columns; scale_t is
    [E, K/2/tkh, N, tkh/16]. merge: as gmm_nt's."""
    E, N, Kh = packed.shape
    M_pad = x.shape[0]
    out = lambda j, i, g, t, w, b: (t[i], j)  # noqa: E731
    extra, extra_specs, sc = _merge_specs(merge, (N, lambda j: 0), tkh, lambda j: j)
    spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=4,
        grid=(Kh // tkh, vis.group.shape[0]),
        in_specs=[pl.BlockSpec((tm, N), lambda j, i, g, t, w, b: (t[i], 0)),
                  pl.BlockSpec((None, N, tkh), lambda j, i, g, t, w, b: (w[i], 0, j)),
                  pl.BlockSpec((None, None, N, tkh // SCALE_LANES), lambda j, i, g, t, w, b: (w[i], j, 0, 0)),
                  *extra_specs],
        out_specs=[pl.BlockSpec((tm, tkh), out), pl.BlockSpec((tm, tkh), out)],
        scratch_shapes=[pltpu.VMEM((N, tkh), CACHE_DTYPE), pltpu.VMEM((N, tkh), CACHE_DTYPE)],
    )
    kernel = functools.partial(_nn_kernel, n_real=E, tm=tm, rc=_row_chunk(N), matmul=matmul, merge_scale=sc)
    shape = out_struct((M_pad, Kh), out_dtype, axes)
    return pl.pallas_call(kernel, grid_spec=spec, name="mxfp4_gmm_nn" if merge is None else "mxfp4_qat_gmm_nn",
                          out_shape=[shape, shape],
                          **_params(mode, vmem_bytes, cost))(*vis, x, packed, scale_t, *extra)
