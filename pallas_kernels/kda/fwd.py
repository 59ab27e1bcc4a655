"""Forward Pallas kernels for chunkwise KDA (SPEC.md §3).

Two kernels, both over a flat axis Z = batch·heads, on the layout [Z, T_pad, ·]:

1. `chunk_terms` — grid (Z, N chunks), every program independent: in-chunk cumulative
   decay, the pairwise scores P and A with every exponent kept <= 0 (or bounded, under
   a gate lower bound), (I + A)^{-1} by pairwise joins of diagonal blocks, and W, U, Q̃,
   K̃, e^{G_C}. This is where the FLOPs are.
2. `recurrence` — the chunks in order, carrying the [K, V] state:
   V' = U − W h; O = Q̃ h + P V'; h ← e^{G_C} ⊙ h + K̃ᵀ V'. It stores each chunk's incoming
   state for the backward pass. Two layouts of the same step (`default_layout`): on TPU
   a (Z, N) grid streams one chunk per step with the state in VMEM scratch; on GPU one
   program per head loops over the chunks.

Portability rules the kernels follow so one source lowers to Mosaic (TPU) and Triton
(GPU): only 2-D values; no slicing of values (Triton has none) — rows are picked with
masked reductions and sub-chunks loaded from refs; cumulative sums and the triangular
inverse are matmuls (MXU / tensor cores, no cumsum or solve primitives); transposes only
inside dot_general; every matmul dimension ≥ 16 (the chunk size is a multiple of 16).
"""

from __future__ import annotations

import contextvars
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu
from jax.experimental.pallas import triton as pltriton

from pallas_kernels.kda_blocks import pair_join_mask

MODES = ("interpret", "tpu", "triton")
SUB = 16  # sub-chunk width: diagonal blocks are built column by column (or, under a gate
# bound, by one matmul: sub_chunk_factors) at this size
_HI = jax.lax.Precision.HIGHEST

# Every matmul keeps fp32 accuracy (the state spans the whole sequence), in each backend's
# own way. Triton computes an IEEE fp32 dot on CUDA cores, one FMA at a time: for these
# [64, 128] tiles LLVM took over 20 minutes to compile one kernel and the result spilled
# 115 KB per thread (sm_90, Triton 3.9). TF32x3 splits each operand into TF32 high and
# low parts and sums three tensor-core products (Triton's F32DotTC): seconds to compile,
# and fp32-level results (tests/ops/test_kda_engine.py emulates it on CPU).
MATMUL_PRECISION = {"interpret": _HI, "tpu": _HI,
                    "triton": jax.lax.DotAlgorithmPreset.TF32_TF32_F32_X3}
# The traced kernel's precision, set by kernel_call while pallas_call traces it.
_precision = contextvars.ContextVar("kda_matmul_precision", default=_HI)


def matmul(a, b, dims):
    """The one matmul every kernel uses: 2-D, fp32, at the traced mode's precision."""
    return jax.lax.dot_general(a, b, (dims, ((), ())), precision=_precision.get(),
                               preferred_element_type=jnp.float32)


def dot(a, b):
    return matmul(a, b, ((1,), (0,)))


def dot_nt(a, b):  # a @ bᵀ
    return matmul(a, b, ((1,), (1,)))


def dot_tn(a, b):  # aᵀ @ b
    return matmul(a, b, ((0,), (0,)))


def kernel_call(mode, kernel, **kw):
    """pl.pallas_call(kernel, **kw), its kernel traced at `mode`'s matmul precision."""
    call = pl.pallas_call(kernel, **kw)

    def run(*args):
        token = _precision.set(MATMUL_PRECISION[mode])
        try:
            return call(*args)
        finally:
            _precision.reset(token)

    return run


def call_options(mode, n_grid_axes):
    """pallas_call keywords for a lowering mode: the compiler params are per backend."""
    if mode == "interpret":
        return dict(interpret=True)
    if mode == "tpu":
        # Every grid axis is independent (the chunk loop lives inside the kernel), so
        # megacore chips may split any of them.
        return dict(compiler_params=pltpu.CompilerParams(
            dimension_semantics=("parallel",) * n_grid_axes))
    if mode == "triton":
        return dict(compiler_params=pltriton.CompilerParams(num_warps=4, num_stages=1))
    raise ValueError(f"pallas kda: unknown mode {mode!r}; expected one of {MODES}")


def _iota(shape, dim):
    return jax.lax.broadcasted_iota(jnp.int32, shape, dim)


def _row(x, i):
    """Row i of a 2-D value as [1, n] (a masked reduction: portable, unlike slicing)."""
    return jnp.sum(jnp.where(_iota(x.shape, 0) == i, x, 0.0), axis=0, keepdims=True)


def sub_chunk_factors(G_I):
    """(e^{G_i − G_m}, e^{G_m − G_j}) on a sub-chunk's rows [SUB, K], through its middle row
    m: one matmul then scores the whole diagonal block. Only under a gate bounded below
    (`bounded`, pallas_kernels.kda_blocks.score_leaf), where the factors stay within
    e^{±(SUB/2)|lb|} and their products within e^{(SUB−1)|lb|}, finite in fp32."""
    m = _row(G_I, SUB // 2)
    return jnp.exp(G_I - m), jnp.exp(m - G_I)


def _diag_block(q_ref, k_ref, g, i0, bounded):
    """Scores of sub-chunk rows i0.. against themselves, [SUB, SUB] each for q and k.

    Column j is x_i · (k_j ⊙ e^{min(G_i − G_j, 0)}); for i >= j the min is inactive, and
    i < j is masked afterwards, so no exponent is ever positive. Under a bounded gate,
    two matmuls through sub_chunk_factors instead of SUB column steps.
    """
    C = g.shape[0]
    x_q = q_ref[pl.ds(i0, SUB), :]
    x_k = k_ref[pl.ds(i0, SUB), :]
    # Rows i0..i0+SUB of the inclusive cumsum of g, as a matmul (no value slicing).
    G = dot(jnp.where(_iota((SUB, C), 1) <= _iota((SUB, C), 0) + i0, 1.0, 0.0), g)
    col = _iota((SUB, SUB), 1)
    tri = _iota((SUB, SUB), 0) >= col
    if bounded:
        row_f, col_f = sub_chunk_factors(G)
        k_col = x_k * col_f
        return (jnp.where(tri, dot_nt(x_q * row_f, k_col), 0.0),
                jnp.where(tri, dot_nt(x_k * row_f, k_col), 0.0))

    def column(j, acc):
        b_q, b_k = acc
        kj = _row(x_k, j) * jnp.exp(jnp.minimum(G - _row(G, j), 0.0))  # [SUB, K]
        b_q = b_q + jnp.where(col == j, jnp.sum(x_q * kj, axis=1, keepdims=True), 0.0)
        b_k = b_k + jnp.where(col == j, jnp.sum(x_k * kj, axis=1, keepdims=True), 0.0)
        return b_q, b_k

    zero = jnp.zeros((SUB, SUB), jnp.float32)
    b_q, b_k = jax.lax.fori_loop(0, SUB, column, (zero, zero))
    return jnp.where(tri, b_q, 0.0), jnp.where(tri, b_k, 0.0)


def pair_scores(q, k, q_ref, k_ref, g, G, bounded):
    """x_i·(k_j ⊙ e^{G_i−G_j}) for x = q and x = k, [C, C] each, zero above the diagonal.

    Off-diagonal sub-chunk blocks (rows in sub-chunk I, columns before it) factor
    e^{G_i−G_j} through the first token r of I, e^{G_i−G_r}·e^{G_r−G_j}, both <= 0;
    diagonal blocks are built column by column and placed by selector matmuls E B Eᵀ.
    """
    C = g.shape[0]
    p = jnp.zeros((C, C), jnp.float32)
    a = jnp.zeros((C, C), jnp.float32)
    for i0 in range(SUB, C, SUB):
        row_f, col_f = offdiag_factors(G, i0)
        col_k = k * col_f
        p = p + dot_nt(q * row_f, col_k)
        a = a + dot_nt(k * row_f, col_k)
    for i0 in range(0, C, SUB):
        b_q, b_k = _diag_block(q_ref, k_ref, g, i0, bounded)
        sel = selector(C, i0)
        p = p + dot_nt(dot(sel, b_q), sel)
        a = a + dot_nt(dot(sel, b_k), sel)
    return p, a


def offdiag_factors(G, i0):
    """The sub-chunk factorisation through the first token r = i0 of sub-chunk I:
    (e^{G_i−G_r} on rows i of I, else 0; e^{G_r−G_j} on rows j < r, else 0), [C, K] each."""
    C = G.shape[0]
    r_idx = _iota((C, 1), 0)
    ref = _row(G, i0)
    rows = (r_idx >= i0) & (r_idx < i0 + SUB)
    row_f = jnp.where(rows, jnp.exp(jnp.minimum(G - ref, 0.0)), 0.0)
    col_f = jnp.where(r_idx < i0, jnp.exp(jnp.minimum(ref - G, 0.0)), 0.0)
    return row_f, col_f


def chunk_specs(C, heads):
    """BlockSpecs on the (Z, N) grid: per-token blocks [C, d] of a [Z, Tp, d] array, per-batch
    mask blocks of a [B, Tp, d] array, and the per-chunk decay column [K, 1]."""
    tok = lambda d: pl.BlockSpec((None, C, d), lambda z, n: (z, n, 0))  # noqa: E731
    # The head count takes the grid index's dtype: a Python int is int64 under jax_enable_x64.
    per_b = lambda d: pl.BlockSpec(  # noqa: E731
        (None, C, d), lambda z, n: (jax.lax.div(z, jnp.asarray(heads, z.dtype)), n, 0))
    dec = lambda K: pl.BlockSpec((None, K, 1), lambda z, n: (z, n, 0))  # noqa: E731
    return tok, per_b, dec


def selector(C, i0):
    """[C, SUB] 0/1 matrix picking sub-chunk rows i0..i0+SUB (exact in fp32; within
    TF32x3's rounding of the picked values on GPU)."""
    return jnp.where(_iota((C, SUB), 0) == _iota((C, SUB), 1) + i0, 1.0, 0.0)


def unit_lower_inverse(a):
    """(I + A)^{-1} for strictly lower-triangular A [C, C], C a power of two: with T the
    inverses of the diagonal blocks of size s and A_s the blocks just below them,
    T − T A_s T joins them pairwise into blocks of 2s (s = 1, 2, 4, ...): 2·log2(C) − 2
    matmuls. The product formula Π_k (I + (−A)^{2^k}) costs the same but sums powers of A
    far larger than the result: with consecutive keys nearly equal and β ≈ 1 it returned
    garbage (relative error 1e20 at C = 64). k3jax.ops.kda_chunk.unit_lower_inverse is the
    same on NumPy masks."""
    C = a.shape[0]
    row, col = _iota((C, C), 0), _iota((C, C), 1)
    t = jnp.where(row == col, 1.0, 0.0) - jnp.where(pair_join_mask(row, col, 1), a, 0.0)
    s = 2
    while s < C:
        t = t - dot(t, dot(jnp.where(pair_join_mask(row, col, s), a, 0.0), t))
        s *= 2
    return t


def _terms_kernel(q_ref, k_ref, v_ref, g_ref, b_ref, same_ref, sin_ref, rout_ref,
                  qd_ref, p_ref, w_ref, u_ref, kt_ref, dec_ref, *, bounded):
    C, K = q_ref.shape
    q, k, v, g = q_ref[...], k_ref[...], v_ref[...], g_ref[...]
    beta, sees_in, reaches_out = b_ref[...], sin_ref[...], rout_ref[...]  # [C, 1]
    row, col = _iota((C, C), 0), _iota((C, C), 1)
    G = dot(jnp.where(row >= col, 1.0, 0.0), g)  # inclusive cumsum over the chunk
    # The chunk's total decay as G's own last row, not a separate sum: G_C − G_i must be
    # exactly the suffix that G's rounding implies, or the outgoing state (dominated by
    # the last tokens under strong decay) inherits G's absolute error (~1e-4 at |G|~1e3).
    G_last = _row(G, C - 1)  # [1, K]

    p, a = pair_scores(q, k, q_ref, k_ref, g, G, bounded)
    same = same_ref[...]
    p = p * same
    a = jnp.where(row > col, a, 0.0) * same * beta
    inv = unit_lower_inverse(a)

    eG = jnp.exp(G)
    inside = sees_in > 0  # rows with no document start since the chunk began
    w_ref[...] = dot(inv, beta * jnp.where(inside, k * eG, 0.0))
    u_ref[...] = dot(inv, beta * v)
    qd_ref[...] = jnp.where(inside, q * eG, 0.0)
    p_ref[...] = p
    kt_ref[...] = jnp.where(reaches_out > 0, k * jnp.exp(jnp.minimum(G_last - G, 0.0)), 0.0)
    clean = _row(sees_in, C - 1)  # [1, 1]: the incoming state survives the whole chunk
    dec = jnp.where(clean > 0, jnp.exp(G_last), 0.0)  # [1, K]
    eye_k = _iota((K, K), 0) == _iota((K, K), 1)
    dec_ref[...] = jnp.sum(jnp.where(eye_k, dec, 0.0), axis=1, keepdims=True)  # as [K, 1]


def chunk_terms(q, k, v, g, beta, same, sees_in, reaches_out, *, heads, chunk_size, mode,
                bounded=False):
    """q, k, g [Z, Tp, K], v [Z, Tp, V], beta [Z, Tp, 1]; masks per batch row:
    same [B, Tp, C], sees_in / reaches_out [B, Tp, 1] (float 0/1); bounded: the gate's
    lower bound allows sub_chunk_factors.

    Returns (Q̃, P, W, U, K̃ [Z, Tp, ·], decay [Z, N·K, 1]).
    """
    Z, Tp, K = q.shape
    V, C, H = v.shape[-1], chunk_size, heads
    N = Tp // C
    tok, per_b, dec = chunk_specs(C, H)
    f32 = jnp.float32
    return kernel_call(
        mode, functools.partial(_terms_kernel, bounded=bounded),
        grid=(Z, N),
        in_specs=[tok(K), tok(K), tok(V), tok(K), tok(1), per_b(C), per_b(1), per_b(1)],
        out_specs=[tok(K), tok(C), tok(K), tok(V), tok(K), dec(K)],
        out_shape=[jax.ShapeDtypeStruct((Z, Tp, K), f32), jax.ShapeDtypeStruct((Z, Tp, C), f32),
                   jax.ShapeDtypeStruct((Z, Tp, K), f32), jax.ShapeDtypeStruct((Z, Tp, V), f32),
                   jax.ShapeDtypeStruct((Z, Tp, K), f32), jax.ShapeDtypeStruct((Z, N * K, 1), f32)],
        name="kda_chunk_terms",
        **call_options(mode, 2),
    )(q, k, v, g, beta, same, sees_in, reaches_out)


def chunk_step(qd, p, w, u, kt, dec, h):
    """One chunk of the state loop on 2-D values: returns (O, outgoing h)."""
    v_new = u - dot(w, h)
    return dot(qd, h) + dot(p, v_new), dec * h + dot_tn(kt, v_new)


def _recurrence_loop_kernel(qd_ref, p_ref, w_ref, u_ref, kt_ref, dec_ref, h0_ref,
                            o_ref, hs_ref, ht_ref, *, chunk_size):
    """GPU layout: one program per (batch, head) walks all chunks; refs stay in HBM."""
    C = chunk_size
    K = h0_ref.shape[0]
    N = qd_ref.shape[0] // C

    def chunk(n, h):
        t = pl.multiple_of(n * C, C)
        s = pl.multiple_of(n * K, K)
        hs_ref[pl.ds(s, K), :] = h
        tok = lambda r: r[pl.ds(t, C), :]  # noqa: E731
        o, h = chunk_step(tok(qd_ref), tok(p_ref), tok(w_ref), tok(u_ref), tok(kt_ref),
                          dec_ref[pl.ds(s, K), :], h)
        o_ref[pl.ds(t, C), :] = o
        return h

    ht_ref[...] = jax.lax.fori_loop(0, N, chunk, h0_ref[...])


def _recurrence_stream_kernel(qd_ref, p_ref, w_ref, u_ref, kt_ref, dec_ref, h0_ref,
                              o_ref, hs_ref, ht_ref, h_scr):
    """TPU layout: grid (Z, N) with the chunk axis sequential; each step sees one chunk's
    blocks, and the state lives in a VMEM scratch, so VMEM use does not grow with T."""
    n = pl.program_id(1)

    @pl.when(n == 0)
    def _():
        h_scr[...] = h0_ref[...]

    hs_ref[...] = h_scr[...]
    o, h = chunk_step(qd_ref[...], p_ref[...], w_ref[...], u_ref[...], kt_ref[...],
                      dec_ref[...], h_scr[...])
    o_ref[...] = o
    h_scr[...] = h

    @pl.when(n == pl.num_programs(1) - 1)
    def _():
        ht_ref[...] = h


def default_layout(mode):
    """'stream' (grid over chunks, VMEM scratch state) where the grid runs in order — TPU
    and interpret mode; 'loop' (a loop inside one program per head) on Triton, whose
    programs run concurrently."""
    return "loop" if mode == "triton" else "stream"


def stream_call_options(mode):
    if mode == "tpu":
        return dict(compiler_params=pltpu.CompilerParams(
            dimension_semantics=("parallel", "arbitrary")))
    return call_options(mode, 2)


def recurrence(qd, p, w, u, kt, dec, h0, *, chunk_size, mode, layout=None):
    """The state loop. Returns (O [Z, Tp, V], incoming states [Z, N·K, V], final [Z, K, V])."""
    Z, Tp, K = qd.shape
    V = u.shape[-1]
    C = chunk_size
    N = Tp // C
    f32 = jnp.float32
    out_shape = [jax.ShapeDtypeStruct((Z, Tp, V), f32), jax.ShapeDtypeStruct((Z, N * K, V), f32),
                 jax.ShapeDtypeStruct((Z, K, V), f32)]
    args = (qd, p, w, u, kt, dec, h0)
    if (layout or default_layout(mode)) == "loop":
        whole = lambda *d: pl.BlockSpec((None, *d), lambda z: (z,) + (0,) * len(d))  # noqa: E731
        return kernel_call(
            mode, functools.partial(_recurrence_loop_kernel, chunk_size=C),
            grid=(Z,),
            in_specs=[whole(Tp, K), whole(Tp, C), whole(Tp, K), whole(Tp, V), whole(Tp, K),
                      whole(N * K, 1), whole(K, V)],
            out_specs=[whole(Tp, V), whole(N * K, V), whole(K, V)],
            out_shape=out_shape,
            name="kda_recurrence_fwd",
            **call_options(mode, 1),
        )(*args)
    blk = lambda r, d: pl.BlockSpec((None, r, d), lambda z, n: (z, n, 0))  # noqa: E731
    per_z = lambda r, d: pl.BlockSpec((None, r, d), lambda z, n: (z, 0, 0))  # noqa: E731
    return kernel_call(
        mode, _recurrence_stream_kernel,
        grid=(Z, N),
        in_specs=[blk(C, K), blk(C, C), blk(C, K), blk(C, V), blk(C, K), blk(K, 1), per_z(K, V)],
        out_specs=[blk(C, V), blk(K, V), per_z(K, V)],
        out_shape=out_shape,
        scratch_shapes=[pltpu.VMEM((K, V), f32)],
        name="kda_recurrence_fwd",
        **stream_call_options(mode),
    )(*args)
