"""Chunkwise (UT / WY) form of Kimi Delta Attention, SPEC.md §3.

Callers go through `k3jax.ops.kda.kda(..., impl="chunk")`; this module holds the math.
Inputs here are already fp32, q already carries the attention scale, and packed documents
arrive as a boolean `reset` [B, T] (True where the state restarts from zero).

Within a chunk of C tokens, with G the in-chunk cumulative log decay:
  A = StrictTril(diag(β) [k_i·(k_j ⊙ e^{G_i−G_j})]),  (I + A) [W | U] = diag(β) [K ⊙ e^G | V],
  P = Tril_incl(q_i·(k_j ⊙ e^{G_i−G_j})),  K̃ = K ⊙ e^{G_C−G},  Q̃ = Q ⊙ e^G,
and per chunk, carrying h:  V' = U − W h;  O = Q̃ h + P V';  h ← Diag(e^{G_C}) h + K̃ᵀ V'.

Every exponent is kept <= 0: the gate can be unbounded below (Kimi-Linear's softplus
gate), so e^{G_j−G_i} for j < i would overflow. Pairwise decays are either masked before
the exp (diagonal sub-chunk blocks) or factored through a reference token that sits
between i and j (off-diagonal sub-chunk blocks), so each factor is e^{≤0}.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import jax
import jax.numpy as jnp

# fp32 matmuls throughout: the state accumulates over the whole sequence and the decays
# span many orders of magnitude, so bf16 passes (TPU default precision) are not enough.
_PREC = jax.lax.Precision.HIGHEST

# Width of the sub-chunks whose diagonal blocks get an elementwise [c, c, K] decay tensor.
_SUB = 16


def _einsum(spec, *operands):
    return jnp.einsum(spec, *operands, precision=_PREC)


class ChunkTerms(NamedTuple):
    """Per-chunk quantities, each [B, H, N, ...] (N chunks of C tokens)."""

    q_decayed: jax.Array  # Q̃, rows that see the incoming state: [..., C, K]
    p: jax.Array  # intra-chunk causal scores P, incl. diagonal: [..., C, C]
    w: jax.Array  # W: [..., C, K]
    u: jax.Array  # U: [..., C, V]
    k_tail: jax.Array  # K̃, rows that reach the outgoing state: [..., C, K]
    decay: jax.Array  # e^{G_C}, zero if a document starts inside the chunk: [..., K]


def _to_chunks(x, n_chunks, chunk_size):
    """[B, T, H, ...] -> [B, H, N, C, ...], zero-padded in T."""
    b, t, h = x.shape[:3]
    pad = n_chunks * chunk_size - t
    x = jnp.pad(x, [(0, 0), (0, pad)] + [(0, 0)] * (x.ndim - 2))
    x = x.reshape(b, n_chunks, chunk_size, h, *x.shape[3:])
    return jnp.moveaxis(x, 3, 1)


def _intra_chunk_scores(q, k, G, sub):
    """Raw pairwise scores x_i·(k_j ⊙ e^{G_i−G_j}) for x = q and x = k, [..., C, C].

    Entries with j > i are zero; the caller applies the causal / same-document masks.
    """
    *lead, C, K = k.shape
    n = C // sub
    qs, ks, Gs = (x.reshape(*lead, n, sub, K) for x in (q, k, G))

    # Off-diagonal blocks (sub-chunk J < I): the first token of sub-chunk I sits between
    # every j in J and every i in I, so e^{G_i−G_ref} and e^{G_ref−G_j} are both e^{≤0}.
    ref = Gs[..., :, :1, :]  # [..., n, 1, K]
    row = jnp.exp(Gs - ref)  # [..., I, i, K]
    below = (jnp.arange(n)[:, None] > jnp.arange(n)[None, :])[:, :, None, None]  # [I, J, 1, 1]
    d_col = ref[..., :, None, :, :] - Gs[..., None, :, :, :]  # [..., I, J, j, K]
    # Mask before the exp (J >= I would give positive exponents) and after it, so the
    # masked branch neither overflows nor leaks a gradient.
    col = jnp.where(below, ks[..., None, :, :, :] * jnp.exp(jnp.where(below, d_col, 0.0)), 0.0)
    off_q = _einsum("...Iik,...IJjk->...IJij", qs * row, col)
    off_k = _einsum("...Iik,...IJjk->...IJij", ks * row, col)

    # Diagonal blocks: an elementwise decay tensor, masked to i >= j before the exp.
    tri = (jnp.arange(sub)[:, None] >= jnp.arange(sub)[None, :])[:, :, None]  # [i, j, 1]
    d_diag = Gs[..., :, :, None, :] - Gs[..., :, None, :, :]  # [..., n, i, j, K]
    e_diag = jnp.where(tri, jnp.exp(jnp.where(tri, d_diag, 0.0)), 0.0)
    diag_q = _einsum("...nik,...njk,...nijk->...nij", qs, ks, e_diag)
    diag_k = _einsum("...nik,...njk,...nijk->...nij", ks, ks, e_diag)

    on_diag = jnp.eye(n, dtype=bool)[:, :, None, None]

    def assemble(off, diag):
        blocks = jnp.where(on_diag, diag[..., :, None, :, :], off)  # [..., I, J, i, j]
        return jnp.swapaxes(blocks, -3, -2).reshape(*lead, C, C)

    return assemble(off_q, diag_q), assemble(off_k, diag_k)


def chunk_terms(q, k, v, g, beta, reset, chunk_size) -> ChunkTerms:
    """Everything about each chunk that does not depend on its incoming state.

    q, k [B,T,H,K], v [B,T,H,V], g [B,T,H,K], beta [B,T,H] fp32 (q pre-scaled);
    reset [B,T] bool. T is zero-padded up to a multiple of chunk_size: a padded token
    has g = 0 and β = 0, so it neither decays nor writes the state, and q = 0 reads nothing.
    """
    B, T, H, _ = q.shape
    n_chunks = max(1, -(-T // chunk_size))

    # Work on one flat batch axis Z = B·H·N: XLA:CPU (jax 0.10.2) segfaults in the
    # gradient of these elementwise-plus-einsum blocks when a size-1 axis sits between
    # larger leading axes (e.g. [B, H, 1, C, K]); a single batch axis avoids it.
    def flat(x):
        x = _to_chunks(x, n_chunks, chunk_size)
        return x.reshape(-1, *x.shape[3:])

    q, k, v, g, beta = (flat(x) for x in (q, k, v, g, beta))  # [Z, C, ...]

    # Document structure per chunk, as masks (never -inf gates: inf − inf = nan).
    r = jnp.pad(reset, [(0, 0), (0, n_chunks * chunk_size - T)])
    r = jnp.cumsum(r.reshape(B, 1, n_chunks, chunk_size).astype(jnp.int32), axis=-1)
    r = jnp.broadcast_to(r, (B, H, n_chunks, chunk_size)).reshape(-1, chunk_size)
    sees_in = r == 0  # no reset between the chunk start and this token (inclusive)
    reaches_out = r == r[..., -1:]  # no reset after this token within the chunk
    same_doc = r[..., :, None] == r[..., None, :]  # [Z, C, C]
    clean = r[..., -1] == 0  # the incoming state survives the whole chunk

    G = jnp.cumsum(g, axis=-2)
    G_last = G[..., -1:, :]
    sub = math.gcd(chunk_size, _SUB)
    p_raw, a_raw = _intra_chunk_scores(q, k, G, sub)
    causal = jnp.tril(jnp.ones((chunk_size, chunk_size), dtype=bool))
    strict = jnp.tril(jnp.ones((chunk_size, chunk_size), dtype=bool), k=-1)
    p = jnp.where(causal & same_doc, p_raw, 0.0)
    a = jnp.where(strict & same_doc, a_raw, 0.0) * beta[..., :, None]

    # (I + A)^{-1} diag(β) applied to [K ⊙ e^G | V] in one exact triangular solve; T itself
    # is never formed. Rows past a reset must not read the incoming state, so their
    # K ⊙ e^G rows are zeroed (A couples only tokens of the same document).
    k_decayed = jnp.where(sees_in[..., None], k * jnp.exp(G), 0.0)
    rhs = beta[..., None] * jnp.concatenate([k_decayed, v], axis=-1)
    eye = jnp.eye(chunk_size, dtype=a.dtype)
    wu = jax.lax.linalg.triangular_solve(eye + a, rhs, left_side=True, lower=True, unit_diagonal=True)
    w, u = wu[..., : k.shape[-1]], wu[..., k.shape[-1] :]

    terms = ChunkTerms(
        q_decayed=jnp.where(sees_in[..., None], q * jnp.exp(G), 0.0),
        p=p,
        w=w,
        u=u,
        k_tail=jnp.where(reaches_out[..., None], k * jnp.exp(G_last - G), 0.0),
        decay=jnp.where(clean[..., None], jnp.exp(G_last[..., 0, :]), 0.0),
    )
    return jax.tree.map(lambda x: x.reshape(B, H, n_chunks, *x.shape[1:]), terms)


def chunk_kda(q, k, v, g, beta, initial_state, reset, chunk_size):
    """Chunkwise KDA. fp32 in and out; returns (o [B,T,H,V], final state [B,H,K,V])."""
    T = q.shape[1]
    terms = chunk_terms(q, k, v, g, beta, reset, chunk_size)
    # Scan over chunks (axis 2); only the h-dependent products remain inside the loop.
    xs = jax.tree.map(lambda x: jnp.moveaxis(x, 2, 0), terms)

    def step(h, c: ChunkTerms):
        v_new = c.u - _einsum("bhck,bhkv->bhcv", c.w, h)
        o = _einsum("bhck,bhkv->bhcv", c.q_decayed, h) + _einsum("bhij,bhjv->bhiv", c.p, v_new)
        h = c.decay[..., None] * h + _einsum("bhck,bhcv->bhkv", c.k_tail, v_new)
        return h, o

    h, o = jax.lax.scan(step, initial_state, xs)  # o: [N, B, H, C, V]
    n, b, hh, c, dv = o.shape
    o = jnp.transpose(o, (1, 0, 3, 2, 4)).reshape(b, n * c, hh, dv)
    return o[:, :T], h


def chunk_transitions(k, v, g, beta, reset, chunk_size):
    """Each chunk as an affine map of its incoming state, h ↦ M h + N (SPEC.md §3).

    Returns M [B,H,N,K,K] = Diag(e^{G_C}) − K̃ᵀW and N [B,H,N,K,V] = K̃ᵀU. Composing
    (earlier a, later b) as (M_b M_a, M_b N_a + N_b) is associative, so a prefix scan of
    these yields every chunk's incoming state.
    """
    # The transition does not involve q; k stands in for it and P is simply unused.
    c = chunk_terms(k, k, v, g, beta, reset, chunk_size)
    m = _einsum("...ck,...cj->...kj", c.k_tail, c.w)
    m = jnp.eye(m.shape[-1], dtype=m.dtype) * c.decay[..., None, :] - m
    return m, _einsum("...ck,...cv->...kv", c.k_tail, c.u)
