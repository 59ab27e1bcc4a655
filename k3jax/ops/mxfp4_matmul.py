"""Grouped matmul over MXFP4 experts, dequantized inside the product (SPEC.md §6).

`mxfp4_grouped_matmul(x, packed, scale, group_sizes)` has `grouped_matmul`'s contract
(rows of x sorted by group; group_sizes [E] with Σ <= M; rows past the sum come out zero)
with each expert's weight W_e [N, K] held as the checkpoint stores it: packed uint8
[E, N, K/2] (two E2M1 codes a byte, element 2i in the low nibble) and scale uint8
[E, N, K/32] (E8M0). transpose_rhs=True computes y[r] = x[r] @ W_gᵀ (x [M, K] -> [M, N]:
the forward of w1/w3/w2 in checkpoint orientation), False y[r] = x[r] @ W_g
(x [M, N] -> [M, K]: what the backward needs). Each is the other's gradient with respect
to x; the base is frozen, so packed, scale and group_sizes get zero cotangents.

Decoded values are bit-identical to k3jax.checkpoint.mxfp4.dequantize_mxfp4 in the
compute dtype (x's, bf16 or fp32); products accumulate in fp32; the output has x's dtype.

The pure path (`impl="pure"`) never holds more than a block of experts dequantized: it
walks the blocks of `block_experts` consecutive experts that have rows, decodes that
block once, and runs its rows in windows of L rows starting at the block's first row
(rows of the next block inside the last window are masked out and written by their own
block). On CPU a block is one expert and each window one [L, ·] × [·, ·] dot, like
grouped_matmul's row tiles, with the expert decoded once for all its tiles; elsewhere
blocks of several experts feed `ragged_dot` with the window's own group sizes.
`impl="pallas"` is the fused kernel (pallas_kernels.mxfp4_gmm): Mosaic on TPU, Triton on
GPU, interpret mode on CPU; `impl="auto"` picks it on TPU/GPU and the pure path on CPU.

Inside `shard_map` (the MoE dispatch's, type check on) every impl but interpret-mode
Pallas runs as is: weights split over `tensor` along N (w1/w3) or K (w2) give each shard
its slice of the output or a partial sum, and dx is summed over the axes x is replicated
on by autodiff.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from k3jax.ops.grouped_matmul import tile_rows
from k3jax.ops.platform import target_backend
from pallas_kernels.mxfp4_gmm import mxfp4_gmm
from pallas_kernels.mxfp4_gmm import encode as enc
from pallas_kernels.mxfp4_gmm.decode import e2m1_e8m0, nibbles
from pallas_kernels.mxfp4_gmm.encode import quantize_halves
from pallas_kernels.grouped.manual import vary_together

IMPLS = ("auto", "pure", "pallas")
GROUP = 32  # inputs per E8M0 scale
_HI = jax.lax.Precision.HIGHEST
# Dequantized bytes one block may hold on TPU/GPU in the pure path (the CPU path holds
# one expert).
_BLOCK_BYTES = 256 << 20


def decode_halves(packed, scale, dtype):
    """packed [..., N, K/2], scale [..., N, K/32] -> (W[..., 0::2], W[..., 1::2]), each
    [..., N, K/2] in dtype, exact. Kept apart: interleaving them costs XLA:CPU several
    times the decode (a select per element), while splitting x's columns (or interleaving
    the output's) once per call costs one pass over activations."""
    *lead, n, half = packed.shape
    lo, hi = nibbles(packed.reshape(*lead, n, half * 2 // GROUP, GROUP // 2))
    s = scale.astype(jnp.int32)[..., None]
    return tuple(e2m1_e8m0(c, s, dtype).reshape(*lead, n, half) for c in (lo, hi))


def _check(x, packed, scale, group_sizes, transpose_rhs):
    packed, scale = jnp.asarray(packed), jnp.asarray(scale)
    if packed.dtype != jnp.uint8 or scale.dtype != jnp.uint8:
        raise TypeError(f"mxfp4_grouped_matmul: packed and scale must be uint8, got "
                        f"{packed.dtype} and {scale.dtype}")
    if packed.ndim != 3 or scale.ndim != 3:
        raise ValueError(f"mxfp4_grouped_matmul: packed [E, N, K/2] and scale [E, N, K/32] "
                         f"expected, got shapes {packed.shape} and {scale.shape}")
    E, N, half = packed.shape
    K = 2 * half
    if K % GROUP or scale.shape != (E, N, K // GROUP):
        raise ValueError(f"mxfp4_grouped_matmul: scale shape {scale.shape} does not fit packed "
                         f"{packed.shape} (expected {(E, N, K // GROUP)}: one scale per {GROUP} "
                         f"inputs, K a multiple of {GROUP})")
    d_in = K if transpose_rhs else N
    if x.ndim != 2 or x.shape[1] != d_in:
        raise ValueError(f"mxfp4_grouped_matmul(transpose_rhs={transpose_rhs}): x must be "
                         f"[M, {d_in}] for weights {(E, N, K)} [E, N, K], got {x.shape}")
    if jnp.shape(group_sizes) != (E,):
        raise ValueError(f"mxfp4_grouped_matmul: group_sizes must be [{E}], got "
                         f"{jnp.shape(group_sizes)}")
    if not jnp.issubdtype(x.dtype, jnp.floating):
        raise TypeError(f"mxfp4_grouped_matmul: x must be a float array, got {x.dtype}")
    return packed, scale


def mxfp4_grouped_matmul(x, packed, scale, group_sizes, *, transpose_rhs=True, impl="auto",
                         compute_dtype=None, block_experts=None, window_rows=None,
                         expected_rows=None, merge=None):
    """Rows of x (sorted by group) times their group's MXFP4 weight; see the module doc.

    x [M, K] (transpose_rhs=True) or [M, N]; packed [E, N, K/2] u8; scale [E, N, K/32] u8;
    group_sizes [E] int. Returns [M, N] or [M, K] in x's dtype.
    compute_dtype: the dtype weights are decoded to and x is multiplied in (default x's).
    block_experts / window_rows (pure path): experts decoded at once and rows per product;
    by default one expert and grouped_matmul's row tile on CPU, elsewhere as many experts
    as fit in 256 MiB dequantized. block_experts > 1 uses ragged_dot on every backend.
    expected_rows: the rows doing real work under balanced routing, for the Pallas
    kernels' declared costs.
    merge: quantization-aware fine-tuning's (A, B, alpha/r), adapters in the tree's
    orientation (A [E, K, r] or [K, r] shared, B [E, r, N]): each expert's weight is then
    mxfp4(W + (alpha/r)·(A B)ᵀ), re-quantized block by block (pure) or tile by tile
    (Mosaic or Triton), the exporter's rounding (pallas_kernels.mxfp4_gmm.encode). A and B
    get no gradient here (k3jax.ops.qat adds theirs).
    """
    if impl not in IMPLS:
        raise ValueError(f"mxfp4_grouped_matmul: unknown impl {impl!r}; expected one of {IMPLS}")
    packed, scale = _check(x, packed, scale, group_sizes, transpose_rhs)
    cdt = jnp.dtype(compute_dtype or x.dtype)
    if x.shape[0] == 0:  # no rows (a device that received none): nothing to tile
        return jnp.zeros((0, packed.shape[1] if transpose_rhs else 2 * packed.shape[2]), x.dtype)
    opts = (bool(transpose_rhs), cdt, block_experts, window_rows, impl, expected_rows)
    # Inside shard_map every input is cast to vary over the axes any of them does, outside
    # the custom_vjp: so x's cotangent may vary where the weights do (w1 split over
    # `tensor`), and autodiff sums it over the axes x itself was replicated on.
    if merge is not None:
        a, b, s = merge
        merge_operands(a, b, packed.shape)      # shapes checked here, before any trace
        a, b = jax.lax.stop_gradient((a, b))
        args, _ = vary_together(x, packed, scale, jnp.asarray(group_sizes, jnp.int32), a, b)
        return _qgmm((*opts, float(s)), *args)
    args, _ = vary_together(x, packed, scale, jnp.asarray(group_sizes, jnp.int32))
    return _gmm(opts, *args)


def merge_operands(a, b, packed_shape):
    """(A's even-input rows, its odd ones, Bᵀ) in the layouts the products read: [E|1, r,
    K/2] twice and [E, N, r] (a shared A keeps a leading 1: every expert reads it)."""
    E, N, half = packed_shape
    a = a[None] if a.ndim == 2 else a
    if a.shape[1:] != (2 * half, a.shape[-1]) or b.shape != (E, a.shape[-1], N) or a.shape[0] not in (1, E):
        raise ValueError(f"mxfp4_grouped_matmul: adapters A {a.shape}, B {b.shape} do not fit weights "
                         f"[E, N, K] = {(E, N, 2 * half)} (A [E, K, r] or [K, r], B [E, r, N])")
    a_t = jnp.swapaxes(a, 1, 2).astype(jnp.float32)
    return a_t[..., 0::2], a_t[..., 1::2], jnp.swapaxes(b, 1, 2).astype(jnp.float32)


# -- the differentiable op ----------------------------------------------------------------


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _gmm(opts, x, packed, scale, sizes):
    return _dispatch(x, packed, scale, sizes, *opts)


def _gmm_fwd(opts, x, packed, scale, sizes):
    return _gmm(opts, x, packed, scale, sizes), (packed, scale, sizes)


def _gmm_bwd(opts, res, ct):
    transpose_rhs, *rest = opts
    packed, scale, sizes = res
    # d/dx of x @ Wᵀ is ct @ W and the other way round: the same op, the other orientation.
    dx = _dispatch(ct, packed, scale, sizes, not transpose_rhs, *rest)
    zero = lambda a: np.zeros(a.shape, jax.dtypes.float0)  # noqa: E731 — integer inputs
    return dx, zero(packed), zero(scale), zero(sizes)


_gmm.defvjp(_gmm_fwd, _gmm_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _qgmm(opts, x, packed, scale, sizes, a, b):
    *rest, s = opts
    return _dispatch(x, packed, scale, sizes, *rest, merge=(*merge_operands(a, b, packed.shape), s))


def _qgmm_fwd(opts, x, packed, scale, sizes, a, b):
    # the adapters themselves are the residuals (params, alive anyway): their fp32 layouts
    # are rebuilt in the backward rather than kept for every layer until then
    return _qgmm(opts, x, packed, scale, sizes, a, b), (packed, scale, sizes, a, b)


def _qgmm_bwd(opts, res, ct):
    transpose_rhs, *rest, s = opts
    packed, scale, sizes, a, b = res
    # dx through the same re-quantized weights; the adapters' straight-through gradient
    # is the plain low-rank path's (k3jax.ops.qat), so none flows from here.
    dx = _dispatch(ct, packed, scale, sizes, not transpose_rhs, *rest,
                   merge=(*merge_operands(a, b, packed.shape), s))
    zero = lambda a: np.zeros(a.shape, jax.dtypes.float0)  # noqa: E731
    return dx, zero(packed), zero(scale), zero(sizes), jnp.zeros_like(a), jnp.zeros_like(b)


_qgmm.defvjp(_qgmm_fwd, _qgmm_bwd)


def _dispatch(x, packed, scale, sizes, transpose_rhs, cdt, block, window, impl, expected, merge=None):
    E, N, half = packed.shape
    M = x.shape[0]
    pure = functools.partial(_pure, transpose_rhs=transpose_rhs, cdt=cdt, merge=merge)
    fused = functools.partial(mxfp4_gmm, transpose_rhs=transpose_rhs, compute_dtype=cdt,
                              expected_rows=expected, merge=merge)
    if impl == "pallas":
        return fused(x, packed, scale, sizes)  # Mosaic, Triton or interpret mode per platform
    if block is not None:
        B = max(1, min(int(block), E))
        blocked = functools.partial(pure, B=B, L=window or _window(M, E, B))
        cpu = default = blocked
    else:
        cpu = functools.partial(pure, B=1, L=window or tile_rows(M, E))
        # re-quantizing holds some eight fp32 / int32 temporaries of the block
        B = max(1, min(E, _BLOCK_BYTES // (N * 2 * half * (cdt.itemsize if merge is None else 32))))
        default = functools.partial(pure, B=B, L=window or _window(M, E, B))
    if impl == "auto" and target_backend() == "cpu":
        return cpu(x, packed, scale, sizes)    # not traced beside the kernels: see grouped_matmul
    accel = {}
    if impl == "auto":
        accel = dict(tpu=functools.partial(fused, mode="tpu"),
                     cuda=functools.partial(fused, mode="triton"),
                     rocm=functools.partial(fused, mode="triton"))
    return jax.lax.platform_dependent(x, packed, scale, sizes, cpu=cpu, default=default, **accel)


def _window(m, n_experts, block):
    """Rows per ragged_dot window: about one block's share of the rows, a power of two in
    [128, 2048] (each block wastes at most one partial window)."""
    want = -(-m * block // n_experts)
    return int(min(2048, max(128, 1 << max(0, want - 1).bit_length())))


# -- the pure path --------------------------------------------------------------------------


def _requantized_halves(p, s, merge, e0, B, cdt):
    """The block's (W_lo, W_hi) after merging its adapters and re-quantizing (the exporter's
    rounding), decoded to cdt: values only MXFP4 can hold."""
    lo_t, hi_t, b_t, sc = merge
    lo, hi = decode_halves(p, s, jnp.float32)
    if lo_t.shape[0] > 1:      # per-expert A; a shared one [1, r, K/2] broadcasts
        lo_t, hi_t = (jax.lax.dynamic_slice_in_dim(a, e0, B) for a in (lo_t, hi_t))
    bt = jax.lax.dynamic_slice_in_dim(b_t, e0, B)
    s_new, c_lo, c_hi = quantize_halves(enc.merge(lo, bt, lo_t, sc), enc.merge(hi, bt, hi_t, sc))
    s_new = enc.expand(s_new)
    return e2m1_e8m0(c_lo, s_new, cdt), e2m1_e8m0(c_hi, s_new, cdt)


def _pure(x, packed, scale, sizes, *, transpose_rhs, cdt, B, L, merge=None):
    E, N, half = packed.shape
    M = x.shape[0]
    d_out = N if transpose_rhs else half  # per half when the output is split
    n_blocks = -(-E // B)
    row_end = jnp.cumsum(sizes)
    row_start = row_end - sizes
    # Block b owns experts [b·B, min((b+1)·B, E)); the last block's slice is moved back to
    # fit inside E (dynamic_slice would clamp it so anyway), its extra experts given no rows.
    first = jnp.arange(n_blocks) * B
    last = jnp.minimum(first + B, E) - 1
    blk_start, blk_end = row_start[first], row_end[last]
    # Blocks with rows, in order, then the empty ones (never visited).
    busy = blk_end > blk_start
    order = jnp.argsort(~busy, stable=True)
    n_busy = jnp.sum(busy)

    pad = lambda a: jnp.pad(a.astype(cdt), ((0, L), (0, 0)))  # noqa: E731
    # x @ Wᵀ = x[:, 0::2] @ W_loᵀ + x[:, 1::2] @ W_hiᵀ; x @ W = (x @ W_lo, x @ W_hi) interleaved.
    xs = (pad(x[:, 0::2]), pad(x[:, 1::2])) if transpose_rhs else (pad(x),)
    n_out = 1 if transpose_rhs else 2
    # Under shard_map's type check the loop carry must vary where its updates do (the
    # inputs all vary alike: see mxfp4_grouped_matmul).
    outs = tuple(vary_together(jnp.zeros((M + L, d_out), x.dtype), x)[0][0] for _ in range(n_out))
    rows = jnp.arange(L)

    def product(xw, w, n_rows):
        if B == 1:
            dims = ((1,), (1,)) if transpose_rhs else ((1,), (0,))
            return jax.lax.dot_general(xw, w[0], (dims, ((), ())), precision=_HI,
                                       preferred_element_type=jnp.float32)
        rhs = jnp.swapaxes(w, 1, 2) if transpose_rhs else w  # [B, contracted, out]
        return jax.lax.ragged_dot(xw, rhs, n_rows, precision=_HI,
                                  preferred_element_type=jnp.float32)

    def one_block(k, outs):
        b = order[k]
        e0 = jnp.minimum(b * B, E - B)
        ids = e0 + jnp.arange(B)
        own = ids >= b * B
        p, s = jax.lax.dynamic_slice_in_dim(packed, e0, B), jax.lax.dynamic_slice_in_dim(scale, e0, B)
        w_lo, w_hi = decode_halves(p, s, cdt) if merge is None else _requantized_halves(p, s, merge, e0, B, cdt)
        r0, r1 = blk_start[b], blk_end[b]
        e_start = jnp.where(own, row_start[ids], r0)
        e_end = jnp.where(own, row_end[ids], r0)

        def one_window(j, outs):
            ws = r0 + j * L
            # The window's rows of each expert; ragged_dot takes them from row 0 in order.
            n_rows = jnp.clip(e_end - ws, 0, L) - jnp.clip(e_start - ws, 0, L)
            xw = [jax.lax.dynamic_slice_in_dim(a, ws, L) for a in xs]
            if transpose_rhs:
                ys = (product(xw[0], w_lo, n_rows) + product(xw[1], w_hi, n_rows),)
            else:
                ys = (product(xw[0], w_lo, n_rows), product(xw[0], w_hi, n_rows))
            keep = (rows < r1 - ws)[:, None]
            new = []
            for out, y in zip(outs, ys):
                old = jax.lax.dynamic_slice_in_dim(out, ws, L)
                y = jnp.where(keep, y.astype(out.dtype), old)
                new.append(jax.lax.dynamic_update_slice_in_dim(out, y, ws, 0))
            return tuple(new)

        return jax.lax.fori_loop(0, (r1 - r0 + L - 1) // L, one_window, outs)

    outs = jax.lax.fori_loop(0, n_busy, one_block, outs)
    if transpose_rhs:
        return outs[0][:M]
    return jnp.stack([o[:M] for o in outs], axis=-1).reshape(M, 2 * half)
