"""Fused MXFP4 dequant grouped matmul (Pallas): each kernel decodes its weight tile from
the packed E2M1 bytes and E8M0 scales (decode.py) next to the product, so no dequantized
copy of the experts exists outside a tile.

`mxfp4_gmm(x, packed, scale, group_sizes, transpose_rhs=...)` with packed [E, N, K/2] and
scale [E, N, K/32] (uint8, the checkpoint's [out, in] orientation): x [M, K] -> x @ W_gᵀ
[M, N] (transpose_rhs) or x [M, N] -> x @ W_g [M, K]; rows sorted by group, rows past
Σ sizes zero. Row tiles are visited group by group (pallas_kernels.grouped.visits, megablox style). Two
layouts of the same product: "tpu" (tpu.py: sequential visits, decoded tile cached in
VMEM, Mosaic) and "triton" (triton.py: independent programs, decoded chunk by chunk).
mode "auto" is a `jax.lax.platform_dependent` over Mosaic (TPU), Triton (CUDA, ROCm) and
interpret mode (elsewhere), so one jitted function serves CPU tests and exports for TPU
and CUDA alike. Interpret mode runs either layout.

No kernel sees an interleaved weight: x @ Wᵀ is x[:, 0::2] @ W_loᵀ + x[:, 1::2] @ W_hiᵀ
(the low and high nibbles' values), and x @ W is (x @ W_lo, x @ W_hi) interleaved: the
caller splits x's columns or joins the output's, one pass over activations.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels.grouped.visits import visits
from pallas_kernels.grouped.manual import vary_together
from pallas_kernels.grouped.matmul import matmul_for, pow2
from pallas_kernels.mxfp4_gmm import tpu, triton

MODES = ("auto", "interpret", "tpu", "triton")
LAYOUTS = ("tpu", "triton")


def _tpu_tiles(M, N, Kh, tm=None):
    tm = tm or min(128, -(-M // 8) * 8)
    tn = 256 if N % 256 == 0 else 128 if N % 128 == 0 else N
    tkh = 256 if Kh % 256 == 0 else Kh
    return tm, tn, tkh


def _tpu_vmem(tm, tn, tkh, N, Kh, cdt, transpose_rhs, rank=0):
    """Bytes the TPU kernel's blocks (double-buffered), scratch and decode temporaries take,
    for a vmem_limit above Mosaic's default scoped 16 MiB when a shape needs it. rank > 0:
    re-quantizing (merge): Bᵀ and A's blocks in fp32 and twice the decode temporaries."""
    c = jnp.dtype(cdt).itemsize
    if transpose_rhs:
        blocks = 2 * tm * Kh * c + tn * Kh + tn * 128 + tm * tn * 4
        scratch, temps = 2 * tn * Kh * 2, 32 * Kh * 4 * 12
        blocks += (tn * 128 + 2 * max(rank, 8) * Kh) * 4 if rank else 0
    else:
        blocks = tm * N * c + N * tkh + N * 128 + 2 * tm * tkh * 4
        scratch, temps = 2 * N * tkh * 2, 32 * tkh * 4 * 12 + tm * N * c
        blocks += (N * 128 + 2 * max(rank, 8) * tkh) * 4 if rank else 0
    temps *= 2 if rank else 1
    need = 2 * blocks + scratch + temps
    return None if need < 12 << 20 else int(need * 1.5)


def mxfp4_gmm(x, packed, scale, group_sizes, *, transpose_rhs=True, compute_dtype=None,
              mode="auto", layout=None, tm=None, expected_rows=None, merge=None):
    """See the module doc. compute_dtype: the decoded weights' and x's dtype in the products
    (default x's); the output has x's dtype. layout: for mode="interpret", which kernels
    to run ("tpu" by default); tm: rows per tile (TPU layout; a power of two >= 16 on
    Triton's). expected_rows: the rows doing real work under balanced routing, which the
    kernels' declared cost estimates count (as pallas_kernels.gmm's).
    merge: (A_lo, A_hi [E|1, r, K/2], Bᵀ [E, N, r] fp32, alpha/r) for quantization-aware
    fine-tuning: each decoded tile (TPU layout) or chunk (Triton's) becomes
    mxfp4(W + (alpha/r)·Bᵀ A) (encode.py), in either layout."""
    if mode not in MODES:
        raise ValueError(f"mxfp4_gmm: unknown mode {mode!r}; expected one of {MODES}")
    if layout not in (None, *LAYOUTS):
        raise ValueError(f"mxfp4_gmm: unknown layout {layout!r}; expected one of {LAYOUTS}")
    cdt = jnp.dtype(compute_dtype or x.dtype)
    run = functools.partial(_run, transpose_rhs=transpose_rhs, cdt=cdt, layout=layout, tm=tm,
                            expected_rows=expected_rows, merge=merge)
    if mode != "auto":
        return run(x, packed, scale, group_sizes, mode=mode)
    per = lambda m: functools.partial(run, mode=m)  # noqa: E731
    return jax.lax.platform_dependent(x, packed, scale, group_sizes, tpu=per("tpu"),
                                      cuda=per("triton"), rocm=per("triton"),
                                      default=per("interpret"))


def _triton_tiles(M, N, Kh, cdt, tm=None):
    """Powers of two (Triton's rule), every dot dimension >= 16. x @ Wᵀ: 64-row tiles of
    x and of W (the [64, 64] fp32 accumulator keeps sm_90 free of register spills; 128
    weight rows spilled), 64 packed columns per contraction chunk; x @ W: 64 packed output
    columns (32 in fp32, whose TF32x3 dots need more registers), 64 weight rows a chunk.
    Measured by benchmarks/compile/mxfp4_gmm_triton_compile.py."""
    tm = tm or pow2(M, 16, 64)
    wide = 64 if cdt == jnp.bfloat16 else 32
    return dict(tm=tm, tn=pow2(N, 16, 64), tkh_nt=pow2(Kh, 16, 64), tkh_nn=pow2(Kh, 16, wide),
                tnc=pow2(N, 16, 64))


def _cost(rows, E, N, Kh, c, out_itemsize, x_reads, transpose_rhs):
    """The product's FLOPs for `rows` rows, x read x_reads times, each weight's packed bytes
    and scales once, the output written once."""
    K = 2 * Kh
    x_cols, out_cols = (K, N) if transpose_rhs else (N, K)
    return pl.CostEstimate(flops=int(2 * rows * N * K), transcendentals=0,
                           bytes_accessed=int(rows * (x_cols * c * x_reads + out_cols * out_itemsize)
                                              + E * N * (Kh + K // 32)))


def _run(x, packed, scale, group_sizes, *, transpose_rhs, cdt, layout, tm, expected_rows, mode, merge=None):
    E, N, Kh = packed.shape
    M = x.shape[0]
    rows = M if expected_rows is None else min(M, int(expected_rows))
    layout = layout or ("triton" if mode == "triton" else "tpu")
    if (mode, layout) in (("tpu", "triton"), ("triton", "tpu")):
        raise ValueError(f"mxfp4_gmm: mode {mode!r} runs its own layout, not {layout!r}")
    matmul = matmul_for(mode, cdt)
    if layout == "tpu":
        tm, tn, tkh = _tpu_tiles(M, N, Kh, tm)
        vmem = _tpu_vmem(tm, tn, tkh, N, Kh, cdt, transpose_rhs, 0 if merge is None else merge[2].shape[-1])
    else:
        tiles = _triton_tiles(M, N, Kh, cdt, tm)
        tm = tiles["tm"]
    M_pad = -(-M // tm) * tm
    if merge is None:
        (x, packed, scale, group_sizes), axes = vary_together(x, packed, scale, group_sizes)
    else:
        (x, packed, scale, group_sizes, *ops), axes = vary_together(x, packed, scale, group_sizes, *merge[:3])
        merge = (*ops, merge[3])
    xp = jnp.pad(x.astype(cdt), ((0, M_pad - M), (0, 0)))
    vis = visits(group_sizes, M_pad, tm)
    tiles_n = -(-N // (tn if layout == "tpu" else tiles["tn"])) if transpose_rhs else 1
    cost = _cost(rows, min(E, max(rows, 1)), N, Kh, jnp.dtype(cdt).itemsize, x.dtype.itemsize, tiles_n,
                 transpose_rhs)
    common = dict(tm=tm, out_dtype=x.dtype, mode=mode, matmul=matmul, axes=axes, cost=cost)
    if merge is not None:
        common["merge"] = merge
    if transpose_rhs:
        x_lo, x_hi = xp[:, 0::2], xp[:, 1::2]
        if layout == "tpu":
            y = tpu.gmm_nt(vis, x_lo, x_hi, packed, scale, tn=tn, vmem_bytes=vmem, **common)
        else:
            y = triton.gmm_nt(vis, x_lo, x_hi, packed, scale, tn=tiles["tn"], tkh=tiles["tkh_nt"],
                              **common)
        return y[:M]
    if layout == "tpu":
        # k-tile-major scales, [E, K/2/tkh, N, tkh/16]: 1/16 of the packed bytes, moved once.
        scale_t = jnp.swapaxes(scale.reshape(E, N, Kh // tkh, tkh // tpu.SCALE_LANES), 1, 2)
        lo, hi = tpu.gmm_nn(vis, xp, packed, scale_t, tkh=tkh, vmem_bytes=vmem, **common)
    else:
        lo, hi = triton.gmm_nn(vis, xp, packed, scale, tkh=tiles["tkh_nn"], tnc=tiles["tnc"], **common)
    return jnp.stack([lo[:M], hi[:M]], axis=-1).reshape(M, 2 * Kh)
