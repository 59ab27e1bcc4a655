"""The GPU layout (Triton; also run in interpret mode): one program per (visit,
weight-column tile), every program independent. Visits are the grid's first axis, the one
CUDA allows 2**31 - 1 blocks on (the others 65535).

Triton programs run concurrently and keep nothing between them, so there is no decode
cache and no output tile carried from visit to visit: each program loops over the
contraction in chunks, decoding each chunk's packed bytes and scales as it loads them
(masked past the array's end, so no dimension needs to be a multiple of a tile), and
stores only its group's rows (visits of a straddling tile write disjoint rows; the visits
of group E write the zeros past Σ sizes). Refs are whole arrays and the visit list an
ordinary input: Pallas's Triton lowering has no scalar prefetch. All block sizes are
powers of two (Triton's rule), and every dot dimension is at least 16.

With a merge (quantization-aware fine-tuning) each decoded chunk becomes mxfp4(W + s·Bᵀ A)
before its product, as the TPU layout's tiles do (encode.py, the exporter's rounding): a
chunk holds whole groups of 32 inputs, and the adapters' rows and columns are loaded rank
by rank (a loaded block cannot be sliced), so no merged copy of an expert exists.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from pallas_kernels.mxfp4_gmm import encode
from pallas_kernels.mxfp4_gmm.decode import e2m1_e8m0, nibbles
from pallas_kernels.grouped.manual import out_struct
from pallas_kernels.mxfp4_gmm.tpu import SCALE_LANES, _expand


def _iota(n):
    return jax.lax.broadcasted_iota(jnp.int32, (n,), 0)


def _load_weights(p_ref, s_ref, w, r0, rows, c0, cols, cdt, merge=None):
    """Decoded (low, high) [rows, cols] of expert w's packed rows r0.. and columns c0..
    (zero past the array's end: code 0 under scale 0), merged and re-quantized where a
    merge is given."""
    R, C = p_ref.shape[1:]
    r_ok = r0 + _iota(rows) < R
    c_ok = c0 + _iota(cols) < C
    p = pltriton.load(p_ref.at[w, pl.ds(r0, rows), pl.ds(c0, cols)], mask=r_ok[:, None] & c_ok[None, :], other=0)
    sc = cols // SCALE_LANES
    s = pltriton.load(s_ref.at[w, pl.ds(r0, rows), pl.ds(c0 // SCALE_LANES, sc)],
                      mask=r_ok[:, None] & (c0 // SCALE_LANES + _iota(sc) < C // SCALE_LANES)[None, :], other=0)
    lo, hi = nibbles(p)
    s = _expand(s.astype(jnp.int32), rows, sc)
    if merge is not None:
        lo, hi, s = _requantized(e2m1_e8m0(lo, s), e2m1_e8m0(hi, s), merge, w, r0, r_ok, c0, c_ok)
    return e2m1_e8m0(lo, s, cdt), e2m1_e8m0(hi, s, cdt)


def _requantized(w_lo, w_hi, merge, w, r0, r_ok, c0, c_ok):
    """(low codes, high codes, expanded scales) of mxfp4(W + s·Bᵀ A) for a decoded chunk:
    merge: (A_lo, A_hi [E|1, r, C], Bᵀ [E, R, r] refs, alpha/r), as mxfp4_gmm orders them;
    the adapters loaded one rank at a time."""
    alo_ref, ahi_ref, bt_ref, scale = merge
    rows, cols = r_ok.shape[0], c_ok.shape[0]
    wa = w if alo_ref.shape[0] > 1 else jnp.int32(0)     # a shared A: every expert reads it
    rank = range(bt_ref.shape[2])
    left = [pltriton.load(bt_ref.at[w, pl.ds(r0, rows), pl.ds(j, 1)], mask=r_ok[:, None], other=0) for j in rank]
    right = [[pltriton.load(a_ref.at[wa, pl.ds(j, 1), pl.ds(c0, cols)], mask=c_ok[None, :], other=0) for j in rank]
             for a_ref in (alo_ref, ahi_ref)]
    s_new, lo, hi = encode.quantize_halves(encode.merge_ranks(w_lo, left, right[0], scale),
                                           encode.merge_ranks(w_hi, left, right[1], scale))
    return lo, hi, _expand(s_new, rows, cols // SCALE_LANES)


def _visit(group_ref, tile_ref, weight_ref, bounds_ref, tm):
    i = pl.program_id(0)
    g, t, w = group_ref[i], tile_ref[i], weight_ref[i]
    rows = t * tm + _iota(tm)
    inside = (rows >= bounds_ref[g]) & (rows < bounds_ref[g + 1])
    return g, t * tm, w, inside


def _nt_kernel(group_ref, tile_ref, weight_ref, bounds_ref, xlo_ref, xhi_ref, p_ref, s_ref,
               *refs, n_real, tm, tn, tkh, matmul, merge_scale=None):
    *merge_refs, o_ref = refs
    merge = (*merge_refs, merge_scale) if merge_refs else None
    g, r0, w, inside = _visit(group_ref, tile_ref, weight_ref, bounds_ref, tm)
    Kh = p_ref.shape[2]
    n0 = pl.program_id(1) * tn
    cdt = xlo_ref.dtype

    def chunk(c, acc):
        k0 = c * tkh
        k_ok = (k0 + _iota(tkh) < Kh)[None, :]
        x_lo = pltriton.load(xlo_ref.at[pl.ds(r0, tm), pl.ds(k0, tkh)], mask=k_ok, other=0)
        x_hi = pltriton.load(xhi_ref.at[pl.ds(r0, tm), pl.ds(k0, tkh)], mask=k_ok, other=0)
        w_lo, w_hi = _load_weights(p_ref, s_ref, w, n0, tn, k0, tkh, cdt, merge)
        nt = ((1,), (1,))
        return acc + matmul(x_lo, w_lo, nt) + matmul(x_hi, w_hi, nt)

    # Group E (rows past Σ sizes) runs no chunk and stores zeros.
    steps = jnp.where(g < n_real, jnp.int32(pl.cdiv(Kh, tkh)), jnp.int32(0))
    acc = jax.lax.fori_loop(0, steps, chunk, jnp.zeros((tm, tn), jnp.float32))
    cols_ok = (n0 + _iota(tn) < o_ref.shape[1])[None, :]
    pltriton.store(o_ref.at[pl.ds(r0, tm), pl.ds(n0, tn)], acc.astype(o_ref.dtype),
                   mask=inside[:, None] & cols_ok)


def _nn_kernel(group_ref, tile_ref, weight_ref, bounds_ref, x_ref, p_ref, s_ref,
               *refs, n_real, tm, tkh, tnc, matmul, merge_scale=None):
    *merge_refs, olo_ref, ohi_ref = refs
    merge = (*merge_refs, merge_scale) if merge_refs else None
    g, r0, w, inside = _visit(group_ref, tile_ref, weight_ref, bounds_ref, tm)
    N, Kh = p_ref.shape[1:]
    k0 = pl.program_id(1) * tkh
    cdt = x_ref.dtype

    def chunk(c, acc):
        n0 = c * tnc
        x = pltriton.load(x_ref.at[pl.ds(r0, tm), pl.ds(n0, tnc)],
                          mask=(n0 + _iota(tnc) < N)[None, :], other=0)
        w_lo, w_hi = _load_weights(p_ref, s_ref, w, n0, tnc, k0, tkh, cdt, merge)
        nn = ((1,), (0,))
        return acc[0] + matmul(x, w_lo, nn), acc[1] + matmul(x, w_hi, nn)

    steps = jnp.where(g < n_real, jnp.int32(pl.cdiv(N, tnc)), jnp.int32(0))
    zero = jnp.zeros((tm, tkh), jnp.float32)
    y_lo, y_hi = jax.lax.fori_loop(0, steps, chunk, (zero, zero))
    mask = inside[:, None] & (k0 + _iota(tkh) < Kh)[None, :]
    for o_ref, y in ((olo_ref, y_lo), (ohi_ref, y_hi)):
        pltriton.store(o_ref.at[pl.ds(r0, tm), pl.ds(k0, tkh)], y.astype(o_ref.dtype), mask=mask)


def _whole(a):
    return pl.BlockSpec(a.shape, lambda j, i: (0,) * a.ndim)


def _params(mode, num_warps, cost):
    extra = {} if cost is None else dict(cost_estimate=cost)
    if mode == "interpret":
        return dict(interpret=True, **extra)
    return dict(compiler_params=pltriton.CompilerParams(num_warps=num_warps, num_stages=1), **extra)


def _merge_args(merge):
    """(extra kernel inputs, the static scale) of a merge (A_lo, A_hi, Bᵀ, alpha/r)."""
    if merge is None:
        return (), None
    *ops, scale = merge
    return tuple(ops), float(scale)


def gmm_nt(vis, x_lo, x_hi, packed, scale, *, tm, tn, tkh, out_dtype, mode, matmul, axes, num_warps=4, cost=None,
           merge=None):
    """y [M_pad, N] = x @ W_gᵀ from x's even/odd columns [M_pad, K/2]. merge: (A_lo, A_hi
    [E|1, r, K/2], Bᵀ [E, N, r] fp32, alpha/r): each decoded chunk re-quantized first."""
    E, N, Kh = packed.shape
    extra, sc = _merge_args(merge)
    args = (*vis, x_lo, x_hi, packed, scale, *extra)
    kernel = functools.partial(_nt_kernel, n_real=E, tm=tm, tn=tn, tkh=tkh, matmul=matmul, merge_scale=sc)
    return pl.pallas_call(
        kernel, grid=(vis.group.shape[0], pl.cdiv(N, tn)), in_specs=[_whole(a) for a in args],
        out_specs=pl.BlockSpec((x_lo.shape[0], N), lambda j, i: (0, 0)),
        out_shape=out_struct((x_lo.shape[0], N), out_dtype, axes),
        name="mxfp4_gmm_nt" if merge is None else "mxfp4_qat_gmm_nt", **_params(mode, num_warps, cost))(*args)


def gmm_nn(vis, x, packed, scale, *, tm, tkh, tnc, out_dtype, mode, matmul, axes, num_warps=4, cost=None,
           merge=None):
    """(y_lo, y_hi) [M_pad, K/2]: x [M_pad, N] @ W_g's even / odd columns. merge: as gmm_nt's."""
    E, N, Kh = packed.shape
    extra, sc = _merge_args(merge)
    args = (*vis, x, packed, scale, *extra)
    kernel = functools.partial(_nn_kernel, n_real=E, tm=tm, tkh=tkh, tnc=tnc, matmul=matmul, merge_scale=sc)
    shape = out_struct((x.shape[0], Kh), out_dtype, axes)
    whole_out = pl.BlockSpec(shape.shape, lambda j, i: (0, 0))
    return pl.pallas_call(
        kernel, grid=(vis.group.shape[0], pl.cdiv(Kh, tkh)), in_specs=[_whole(a) for a in args],
        out_specs=[whole_out, whole_out], out_shape=[shape, shape],
        name="mxfp4_gmm_nn" if merge is None else "mxfp4_qat_gmm_nn", **_params(mode, num_warps, cost))(*args)
