"""Backward Pallas kernels of the intra-chunk factorisation (fwd.chunk_terms).

Given the cotangents of one chunk's terms (Q̃, P, W, U, K̃, e^{G_C}) they return dq, dk,
dv, dg, dβ for that chunk; grid (Z, N), every program independent, like the forward. The
forward terms are recomputed in the kernels (scores, (I + A)^{-1}, W, U) rather than
stored. The solve side and the scores' decayed products are two kernels (chunk_terms_bwd).

With T = (I + A)^{-1}, R = diag(β)[K̂ | V] (K̂ = K ⊙ e^G on rows that see the incoming
state) and [W | U] = T R:
  dR = Tᵀ [dW | dU],   dA = −dR [W | U]ᵀ   (strictly lower, same document),
  dβ_i = Σ_j dA_ij S^k_ij + R-row terms,   dS^k = diag(β) dA,   dS^q = dP (causal, same doc).
A score S_ij = x_i·(k_j ⊙ e^{G_i−G_j}) sends, through the decayed products
  Rw(D, Y)_i = Σ_{j<=i} D_ij Y_j ⊙ e^{G_i−G_j}   and   Cl(D, X)_j = Σ_{i>=j} D_ij X_i ⊙ e^{G_i−G_j},
dx += Rw(dS, K), dk += Cl(dS, X), dG += x ⊙ Rw(dS, K) − k ⊙ Cl(dS, X); finally
dg = Lᵀ dG + dG_C (L the inclusive lower triangle of ones). The decayed products use the
forward's sub-chunk factorisation, so every exponent stays <= 0.
Portability rules as in fwd.py (2-D values, no value slicing, matmul dims >= 16).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from pallas_kernels.kda.fwd import (SUB, _iota, _row, call_options, chunk_specs, dot, dot_nt,
                                    dot_tn, kernel_call, offdiag_factors, pair_scores, selector,
                                    sub_chunk_factors, unit_lower_inverse)


def _decayed_products(G, pairs_row, pairs_col, bounded):
    """Rw(D, Y) for each (D, Y) in pairs_row, and Σ Cl(D, X) over pairs_col, over the pairs
    strictly below the diagonal (i > j); every D is [C, C] and zero above the diagonal.
    Under a bounded gate the diagonal blocks go through fwd.sub_chunk_factors.
    Returns ([rw, ...], cl), [C, K] each."""
    C, K = G.shape
    rw = [jnp.zeros((C, K), jnp.float32) for _ in pairs_row]
    cl = jnp.zeros((C, K), jnp.float32)
    # Off-diagonal sub-chunk blocks through the reference token r = i0 (first row of I).
    for i0 in range(SUB, C, SUB):
        row_f, col_f = offdiag_factors(G, i0)
        rw = [r + row_f * dot(d, y * col_f) for r, (d, y) in zip(rw, pairs_row)]
        for d, x in pairs_col:
            cl = cl + col_f * dot_tn(d, x * row_f)
    # Diagonal blocks, column by column on the sub-chunk's rows (selected by matmuls).
    s_col = _iota((SUB, SUB), 1)
    s_idx = _iota((SUB, 1), 0)
    for i0 in range(0, C, SUB):
        sel = selector(C, i0)
        pick = lambda x: dot_tn(sel, x)  # noqa: E731  rows I of x, [SUB, ·]
        G_I = pick(G)
        rows_d = [(dot(pick(d), sel), pick(y)) for d, y in pairs_row]  # D_II, Y_I
        cols_d = [(dot(pick(d), sel), pick(x)) for d, x in pairs_col]
        if bounded:
            row_f, col_f = sub_chunk_factors(G_I)
            below = s_idx > s_col
            rw = [r + dot(sel, row_f * dot(jnp.where(below, d, 0.0), y * col_f))
                  for r, (d, y) in zip(rw, rows_d)]
            for d, x in cols_d:
                cl = cl + dot(sel, col_f * dot_tn(jnp.where(below, d, 0.0), x * row_f))
            continue

        def column(j, acc, G_I=G_I, rows_d=rows_d, cols_d=cols_d):
            rw_I, cl_I = acc
            # e^{G_i − G_j} for rows i > j of the sub-chunk (exponent <= 0), else 0.
            e = jnp.where(s_idx > j, jnp.exp(jnp.minimum(G_I - _row(G_I, j), 0.0)), 0.0)
            col_j = lambda d: jnp.sum(jnp.where(s_col == j, d, 0.0), axis=1, keepdims=True)  # noqa: E731
            rw_I = [r + col_j(d) * _row(y, j) * e for r, (d, y) in zip(rw_I, rows_d)]
            for d, x in cols_d:
                cl_j = jnp.sum(col_j(d) * x * e, axis=0, keepdims=True)  # [1, K]
                cl_I = cl_I + jnp.where(s_idx == j, cl_j, 0.0)
            return rw_I, cl_I

        zero = jnp.zeros((SUB, K), jnp.float32)
        rw_I, cl_I = jax.lax.fori_loop(0, SUB, column, ([zero for _ in rows_d], zero))
        rw = [r + dot(sel, r_I) for r, r_I in zip(rw, rw_I)]
        cl = cl + dot(sel, cl_I)
    return rw, cl


def _solve_bwd_kernel(q_ref, k_ref, v_ref, g_ref, b_ref, same_ref, sin_ref, rout_ref,
                      dqd_ref, dw_ref, du_ref, dkt_ref, ddec_ref,
                      dq_ref, dk_ref, dv_ref, dg_ref, db_ref, dsk_ref, *, bounded):
    """Everything but the scores' decayed products: through the solve, Q̃, K̃ and e^{G_C}.
    Writes dq, dk, dg so far, the final dv and dβ, and dS^k for _scores_bwd_kernel."""
    C, K = q_ref.shape
    q, k, v, g = q_ref[...], k_ref[...], v_ref[...], g_ref[...]
    beta, sees_in, reaches_out = b_ref[...], sin_ref[...], rout_ref[...]  # [C, 1]
    same = same_ref[...]
    row, col = _iota((C, C), 0), _iota((C, C), 1)
    tril = jnp.where(row >= col, 1.0, 0.0)
    G = dot(tril, g)
    # The chunk's total decay as G's own last row, not a separate sum: G_C − G_i must be
    # exactly the suffix that G's rounding implies, or the outgoing state (dominated by
    # the last tokens under strong decay) inherits G's absolute error (~1e-4 at |G|~1e3).
    G_last = _row(G, C - 1)  # [1, K]

    # Recompute the forward terms the cotangents flow through.
    _, a_raw = pair_scores(q, k, q_ref, k_ref, g, G, bounded)
    strict_same = jnp.where(row > col, same, 0.0)
    inv = unit_lower_inverse(a_raw * strict_same * beta)
    eG = jnp.exp(G)
    inside = sees_in > 0
    k_hat = jnp.where(inside, k * eG, 0.0)
    w = dot(inv, beta * k_hat)
    u = dot(inv, beta * v)

    # Through the triangular solve.
    dr_k = dot_tn(inv, dw_ref[...])
    dr_v = dot_tn(inv, du_ref[...])
    d_a = -(dot_nt(dr_k, w) + dot_nt(dr_v, u)) * strict_same
    dbeta = (jnp.sum(d_a * a_raw, axis=1, keepdims=True)
             + jnp.sum(dr_k * k_hat, axis=1, keepdims=True)
             + jnp.sum(dr_v * v, axis=1, keepdims=True))
    dk_hat = beta * dr_k
    dk = jnp.where(inside, dk_hat * eG, 0.0)
    dG = jnp.where(inside, dk_hat * k * eG, 0.0)

    # Q̃ = Q ⊙ e^G on rows that see the incoming state.
    dqd = dqd_ref[...]
    dq = jnp.where(inside, dqd * eG, 0.0)
    dG = dG + jnp.where(inside, dqd * q * eG, 0.0)

    # K̃ = K ⊙ e^{G_C − G} on rows that reach the outgoing state, and e^{G_C}.
    e_tail = jnp.exp(jnp.minimum(G_last - G, 0.0))
    dkt = dkt_ref[...]
    dk = dk + jnp.where(reaches_out > 0, dkt * e_tail, 0.0)
    # G_C − G_i is the sum of g over the tokens after i, so its cotangent t_i goes to those
    # g directly (dg_s += Σ_{i<s} t_i, below). Routed through G it would be G_C's Σ t minus
    # the suffix sums: a difference of large terms that costs dg ~1e-4 under strong decay.
    t = jnp.where(reaches_out > 0, dkt * k * e_tail, 0.0)
    eye_k = _iota((K, K), 0) == _iota((K, K), 1)
    ddec = jnp.sum(jnp.where(eye_k, ddec_ref[...], 0.0), axis=0, keepdims=True)  # [K,1] -> [1,K]
    clean = _row(sees_in, C - 1)
    dG_last = jnp.where(clean > 0, ddec * jnp.exp(G_last), 0.0)

    dq_ref[...] = dq
    dk_ref[...] = dk
    dv_ref[...] = beta * dr_v
    dg_ref[...] = dot_tn(tril, dG) + dot(jnp.where(row > col, 1.0, 0.0), t) + dG_last
    db_ref[...] = dbeta
    dsk_ref[...] = d_a * beta  # S^k is A before β (strictly lower, so no diagonal)


def _scores_bwd_kernel(q_ref, k_ref, g_ref, same_ref, dp_ref, dsk_ref, dq_in, dk_in, dg_in,
                       dq_ref, dk_ref, dg_ref, *, bounded):
    """Through the scores S^q (P) and S^k: adds their decayed products to dq, dk, dg
    (aliased in and out)."""
    C, K = q_ref.shape
    q, k = q_ref[...], k_ref[...]
    row, col = _iota((C, C), 0), _iota((C, C), 1)
    tril = jnp.where(row >= col, 1.0, 0.0)
    G = dot(tril, g_ref[...])
    d_sq = dp_ref[...] * jnp.where(row >= col, same_ref[...], 0.0)
    d_sk = dsk_ref[...]
    # Rw(dS^q, K) and Rw(dS^k, K) stay apart (they multiply q and k in dG); both Cl
    # terms multiply k, so they are summed.
    (rw_q, rw_k), cl = _decayed_products(G, [(d_sq, k), (d_sk, k)], [(d_sq, q), (d_sk, k)], bounded)
    # The diagonal S^q_ii = q_i·k_i has no decay: it reaches dq and dk but not dG, where
    # its two terms would cancel only up to rounding, and the suffix sums into dg would
    # gather that residue over the chunk (dg 2e-5 off under strong decay).
    d_sq_ii = jnp.sum(jnp.where(row == col, d_sq, 0.0), axis=1, keepdims=True)  # [C, 1]
    dq_ref[...] = dq_in[...] + rw_q + d_sq_ii * k
    dk_ref[...] = dk_in[...] + rw_k + cl + d_sq_ii * q
    dg_ref[...] = dg_in[...] + dot_tn(tril, q * rw_q + k * rw_k - k * cl)


def chunk_terms_bwd(q, k, v, g, beta, same, sees_in, reaches_out,
                    dqd, dp, dw, du, dkt, ddec, *, heads, chunk_size, mode, bounded=False):
    """Cotangents of q, k, g [Z, Tp, K], v [Z, Tp, V], β [Z, Tp, 1] from those of the
    chunk terms (layouts and `bounded` as in fwd.chunk_terms).

    Two kernels, each over every chunk: the solve side, then the scores' decayed products,
    which pass dS^k [Z, Tp, C] and add to dq, dk, dg in place. As one kernel Triton
    needed 400 KiB of shared memory at K = 128, C = 64 (sm_90, Triton 3.9), more than any
    GPU has (H100/H200: 227 KiB); split, 96 KiB and 128 KiB (benchmarks/compile/kda_triton_compile.py).
    """
    Z, Tp, K = q.shape
    V, C, H = v.shape[-1], chunk_size, heads
    N = Tp // C
    tok, per_b, dec = chunk_specs(C, H)
    sds = lambda d: jax.ShapeDtypeStruct((Z, Tp, d), jnp.float32)  # noqa: E731
    dq, dk, dv, dg, db, dsk = kernel_call(
        mode, functools.partial(_solve_bwd_kernel, bounded=bounded),
        grid=(Z, N),
        in_specs=[tok(K), tok(K), tok(V), tok(K), tok(1), per_b(C), per_b(1), per_b(1),
                  tok(K), tok(K), tok(V), tok(K), dec(K)],
        out_specs=[tok(K), tok(K), tok(V), tok(K), tok(1), tok(C)],
        out_shape=[sds(K), sds(K), sds(V), sds(K), sds(1), sds(C)],
        name="kda_chunk_terms_bwd",
        **call_options(mode, 2),
    )(q, k, v, g, beta, same, sees_in, reaches_out, dqd, dw, du, dkt, ddec)
    dq, dk, dg = kernel_call(
        mode, functools.partial(_scores_bwd_kernel, bounded=bounded),
        grid=(Z, N),
        in_specs=[tok(K), tok(K), tok(K), per_b(C), tok(C), tok(C), tok(K), tok(K), tok(K)],
        out_specs=[tok(K), tok(K), tok(K)],
        out_shape=[sds(K), sds(K), sds(K)],
        input_output_aliases={6: 0, 7: 1, 8: 2},
        name="kda_scores_bwd",
        **call_options(mode, 2),
    )(q, k, g, same, dp, dsk, dq, dk, dg)
    return dq, dk, dv, dg, db
