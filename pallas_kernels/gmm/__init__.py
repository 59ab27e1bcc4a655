"""Grouped matmul and its transposed form for the routed experts (Pallas).

`gmm(x, w, group_sizes)`: rows of x [M, K] (sorted by group; group_sizes [E], Σ <= M)
times their group's w [E, K, N] -> [M, N], rows past Σ sizes zero; `transpose_rhs=True`
takes w as [E, N, K] (x [M, K] -> [M, N] through W_gᵀ: dx of the forward).
`tgmm(x, dy, group_sizes)`: the weight gradient, [E, K, N] with group e's
Σ_{r in e} x_rᵀ dy_r — only each expert's own rows, where XLA's transpose of `ragged_dot`
multiplies every row by every local expert and masks afterwards. An expert without rows
gets a zero gradient.

Products accumulate in fp32; fp32 operands at fp32 accuracy (HIGHEST on TPU, TF32x3 on
Triton: pallas_kernels.mxfp4_gmm's rule). Two layouts (tpu.py: Mosaic, sequential visits;
triton.py: independent programs); mode "auto" is a `jax.lax.platform_dependent` over
Mosaic (TPU), Triton (CUDA, ROCm) and interpret mode elsewhere. Outputs are typed with the
manual mesh axes their inputs vary over, so both run inside the MoE's `shard_map` with its
type check on.

`expected_rows`: the rows a call does real work for under balanced routing (the `ep`
receive buffer holds a dropless worst case, P times that), which the kernels' declared
cost estimates count (k3jax.aot reads them) instead of the whole buffer. Visits of rows
past Σ sizes do no product, so this is also what the kernels run.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels.gmm import tpu, triton
from pallas_kernels.grouped.visits import visits
from pallas_kernels.grouped.matmul import matmul_for, pow2
from pallas_kernels.grouped.manual import vary_together

MODES = ("auto", "interpret", "tpu", "triton")
LAYOUTS = ("tpu", "triton")


def _tpu_tile(d):
    """A lane-dim tile: the largest of 512, 256, 128 dividing d, else d whole (Mosaic takes a
    block dim that is a multiple of 128 or the whole array dim)."""
    return next((t for t in (512, 256, 128) if d % t == 0), d)


def _tpu_rows(M, dtype):
    sub = 16 if jnp.dtype(dtype).itemsize < 4 else 8
    return 128 if M >= 128 else -(-M // sub) * sub


def _vmem(tm, tk, tn, c, co):
    """Bytes of double-buffered blocks and the accumulator; a limit above Mosaic's default
    scoped VMEM (16 MiB on v4/v5) only where a shape needs it."""
    need = 2 * (tm * tk * c + tk * tn * c + tm * tn * co) + tm * tn * 4 + tk * tn * 4
    return None if need < 12 << 20 else int(need * 1.5)


def _cost(rows, K, N, E, c, reads_x, reads_y, weight_itemsize):
    """pl.CostEstimate for `rows` rows doing real work: x [rows, K] read reads_x times, the
    [rows, N] side read or written reads_y times (c bytes an element each), E weights."""
    return pl.CostEstimate(
        flops=int(2 * rows * K * N), transcendentals=0,
        bytes_accessed=int(rows * c * (K * reads_x + N * reads_y) + E * K * N * weight_itemsize))


def _check(mode, layout):
    if mode not in MODES:
        raise ValueError(f"gmm: unknown mode {mode!r}; expected one of {MODES}")
    if layout not in (None, *LAYOUTS):
        raise ValueError(f"gmm: unknown layout {layout!r}; expected one of {LAYOUTS}")


def _dispatch(run, mode, *args):
    if mode != "auto":
        return run(*args, mode=mode)
    per = lambda m: functools.partial(run, mode=m)  # noqa: E731
    return jax.lax.platform_dependent(*args, tpu=per("tpu"), cuda=per("triton"),
                                      rocm=per("triton"), default=per("interpret"))


def _layout(mode, layout, name):
    layout = layout or ("triton" if mode == "triton" else "tpu")
    if (mode, layout) in (("tpu", "triton"), ("triton", "tpu")):
        raise ValueError(f"{name}: mode {mode!r} runs its own layout, not {layout!r}")
    return layout


def gmm(x, w, group_sizes, *, transpose_rhs=False, mode="auto", layout=None, expected_rows=None):
    """See the module doc. x and w share one float dtype (the caller casts); the output has
    it. layout: for mode="interpret", which kernels to run ("tpu" by default)."""
    _check(mode, layout)
    if x.dtype != w.dtype:
        raise TypeError(f"gmm: x and w must share a dtype, got {x.dtype} and {w.dtype}")
    run = functools.partial(_gmm, transpose_rhs=transpose_rhs, layout=layout, expected_rows=expected_rows)
    return _dispatch(run, mode, x, w, group_sizes)


def _gmm(x, w, group_sizes, *, transpose_rhs, layout, expected_rows, mode):
    layout = _layout(mode, layout, "gmm")
    M, K = x.shape
    E = w.shape[0]
    N = w.shape[1] if transpose_rhs else w.shape[2]
    c = x.dtype.itemsize
    rows = M if expected_rows is None else min(M, int(expected_rows))
    (x, w, group_sizes), axes = vary_together(x, w, jnp.asarray(group_sizes, jnp.int32))
    if layout == "tpu":
        tm, tk, tn = _tpu_rows(M, x.dtype), _tpu_tile(K), _tpu_tile(N)
    else:
        tm, tn = pow2(M, 16, 64), pow2(N, 16, 64)
        tk = pow2(K, 16, 64 if x.dtype == jnp.bfloat16 else 32)
    M_pad = -(-M // tm) * tm
    xp = jnp.pad(x, ((0, M_pad - M), (0, 0)))
    vis = visits(group_sizes, M_pad, tm)
    cost = _cost(rows, K, N, min(E, max(rows, 1)), c, -(-N // tn), 1, c)
    common = dict(transpose_rhs=transpose_rhs, tm=tm, tk=tk, tn=tn, out_dtype=x.dtype, mode=mode,
                  matmul=matmul_for(mode, x.dtype), axes=axes, cost=cost)
    if layout == "tpu":
        y = tpu.gmm(vis, xp, w, vmem_bytes=_vmem(tm, tk, tn, c, c), **common)
    else:
        y = triton.gmm(vis, xp, w, **common)
    return y[:M]


def tgmm(x, dy, group_sizes, *, out_dtype=None, mode="auto", layout=None, expected_rows=None):
    """See the module doc: [E, K, N] in out_dtype (default x's). x [M, K] and dy [M, N]
    share one float dtype."""
    _check(mode, layout)
    if x.dtype != dy.dtype:
        raise TypeError(f"tgmm: x and dy must share a dtype, got {x.dtype} and {dy.dtype}")
    run = functools.partial(_tgmm, out_dtype=jnp.dtype(out_dtype or x.dtype), layout=layout,
                            expected_rows=expected_rows)
    return _dispatch(run, mode, x, dy, group_sizes)


def _tgmm(x, dy, group_sizes, *, out_dtype, layout, expected_rows, mode):
    layout = _layout(mode, layout, "tgmm")
    M, K = x.shape
    N = dy.shape[1]
    E = group_sizes.shape[0]
    c = x.dtype.itemsize
    rows = M if expected_rows is None else min(M, int(expected_rows))
    (x, dy, group_sizes), axes = vary_together(x, dy, jnp.asarray(group_sizes, jnp.int32))
    if layout == "tpu":
        tm, tk, tn = _tpu_rows(M, x.dtype), _tpu_tile(K), _tpu_tile(N)
    else:
        tk, tn = pow2(K, 16, 64), pow2(N, 16, 64)
        tm = pow2(M, 16, 64 if x.dtype == jnp.bfloat16 else 32)
    cost = _cost(rows, K, N, E, c, -(-N // tn), -(-K // tk), out_dtype.itemsize)
    common = dict(tm=tm, tk=tk, tn=tn, out_dtype=out_dtype, mode=mode,
                  matmul=matmul_for(mode, x.dtype), axes=axes, cost=cost)
    if layout == "triton":
        vis = visits(group_sizes, -(-M // tm) * tm, tm)
        return triton.tgmm(vis.bounds, x, dy, E, **common)
    M_pad = -(-M // tm) * tm
    pad = lambda a: jnp.pad(a, ((0, M_pad - M), (0, 0)))  # noqa: E731
    vis = visits(group_sizes, M_pad, tm, every_group=True)
    return tpu.tgmm(vis, pad(x), pad(dy), E, vmem_bytes=_vmem(tm, tk, tn, c, out_dtype.itemsize), **common)
