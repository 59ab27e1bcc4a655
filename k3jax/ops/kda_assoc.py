"""KDA through chunk transitions: the associative scan (kda(impl="assoc"), SPEC.md §3).

Each chunk acts on its incoming state as an affine map h ↦ M h + N, with
M = Diag(e^{G_C}) − K̃ᵀW [K, K] and N = K̃ᵀU [K, V]. Composing an earlier map a with a later
map b gives (M_b M_a, M_b N_a + N_b): associative, not commutative. `assoc_kda` takes all
chunk transitions at once, a `jax.lax.associative_scan` for every chunk's incoming state in
logarithmic depth, then every chunk's output in one batched pass. No sequential loop over
chunks at all, at the price of K×K matrix products in the scan (worth it when the chunk
loop, not the FLOPs, bounds the time: long sequences on wide accelerators).
`compose` / `apply` serve context parallelism (kda_context.py) too.

Inputs are fp32 and q carries the attention scale, as in kda_chunk; packed documents
arrive as `reset` [B, T] bool.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from k3jax.ops import kda_chunk

_PREC = jax.lax.Precision.HIGHEST


def _einsum(spec, *operands):
    return jnp.einsum(spec, *operands, precision=_PREC)


def compose(a, b):
    """(M, N) of `a` then `b` (a earlier): h ↦ M_b (M_a h + N_a) + N_b."""
    m_a, n_a = a
    m_b, n_b = b
    return _einsum("...ij,...jk->...ik", m_b, m_a), _einsum("...ij,...jv->...iv", m_b, n_a) + n_b


def terms_to_transitions(terms: kda_chunk.ChunkTerms):
    """Per-chunk (M [..., K, K], N [..., K, V]) from chunk terms of shape [..., C, ·]."""
    return kda_chunk._transitions(terms)


def apply(mn, h):
    m, n = mn
    return _einsum("...kj,...jv->...kv", m, h) + n


def _chunk_outputs(terms: kda_chunk.ChunkTerms, h_in):
    """Outputs of every chunk given its incoming state h_in [Z, K, V]; terms [Z, C, ·]."""
    v_new = terms.u - _einsum("zck,zkv->zcv", terms.w, h_in)
    return _einsum("zck,zkv->zcv", terms.q_decayed, h_in) + _einsum("zij,zjv->ziv", terms.p, v_new)


def _prefix(terms):
    """Inclusive prefix composition of the chunk maps along the chunk axis (2)."""
    return jax.lax.associative_scan(compose, terms_to_transitions(terms), axis=2)


def _local_scan(terms, h0, prefix):
    """Outputs of every chunk, and the state after the last one.

    terms are [B, H, N, ...], prefix = _prefix(terms); h0 [B, H, K, V].
    Returns (outputs [B, H, N, C, V], final [B, H, K, V]).
    """
    B, H, N = terms.w.shape[:3]
    after = apply(prefix, h0[:, :, None])  # state after chunk n: [B, H, N, K, V]
    h_in = jnp.concatenate([h0[:, :, None], after[:, :, :-1]], axis=2)
    # The batched output products run on one flat axis Z = B·H·N (the jaxlib CPU gradient
    # segfault with size-1 axes between larger ones, see kda_chunk.chunk_terms).
    flat = lambda x: x.reshape(B * H * N, *x.shape[3:])  # noqa: E731
    o = _chunk_outputs(jax.tree.map(flat, terms), flat(h_in))
    return o.reshape(B, H, N, *o.shape[1:]), after[:, :, -1]


def _untile(o, T):
    """[B, H, N, C, V] -> [B, T, H, V]."""
    B, H, N, C, V = o.shape
    return jnp.transpose(o, (0, 2, 3, 1, 4)).reshape(B, N * C, H, V)[:, :T]


def assoc_kda(q, k, v, g, beta, initial_state, reset, chunk_size, gate_lower_bound=None):
    """Chunkwise KDA with an associative scan over chunks; fp32 in and out."""
    T = q.shape[1]
    terms = kda_chunk.chunk_terms(q, k, v, g, beta, reset, chunk_size, gate_lower_bound)
    o, h = _local_scan(terms, initial_state, _prefix(terms))
    return _untile(o, T), h
