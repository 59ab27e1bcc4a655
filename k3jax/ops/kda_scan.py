"""KDA through chunk transitions: associative scan and context parallelism (SPEC.md §3).

Each chunk (or a whole device's segment) acts on its incoming state as an affine map
h ↦ M h + N, with M = Diag(e^{G_C}) − K̃ᵀW [K, K] and N = K̃ᵀU [K, V]. Composing an earlier
map a with a later map b gives (M_b M_a, M_b N_a + N_b): associative, not commutative.

- `assoc_kda` (kda(impl="assoc")): all chunk transitions at once, a
  `jax.lax.associative_scan` for every chunk's incoming state in logarithmic depth, then
  every chunk's output in one batched pass. No sequential loop over chunks at all, at the
  price of K×K matrix products in the scan (worth it when the chunk loop, not the FLOPs,
  bounds the time: long sequences on wide accelerators).
- `context_parallel_kda`: the same idea across devices. Called inside `jax.shard_map`
  with the time axis split over a mesh axis; each device reduces its segment to one
  (M, N) pair with a pass of any impl, the fixed-size pairs are all-gathered and
  prefix-combined, and each device finishes from its true incoming state. Communication
  is O(K·(K+V)) per head and device, independent of the sequence length.
- `sharded_kda`: `kda` over a device mesh from outside any shard_map, each device its own
  slice of batch and heads (and of time, through context_parallel_kda).

Inputs are fp32 and q carries the attention scale, as in kda_chunk; packed documents
arrive as `reset` [B, T] bool.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

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


def _apply(mn, h):
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
    after = _apply(prefix, h0[:, :, None])  # state after chunk n: [B, H, N, K, V]
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


def context_parallel_kda(
    q,
    k,
    v,
    g,
    beta,
    *,
    axis_name="context",
    scale=None,
    initial_state=None,
    output_final_state=False,
    segment_ids=None,
    impl="chunk",
    chunk_size=64,
    gate_lower_bound=None,
):
    """`kda` on this device's slice of the time axis, inside `jax.shard_map`.

    Arguments are the local shards ([B, T_local, H, ·]; segment_ids [B, T_local]) and mean
    what they mean for `k3jax.ops.kda.kda`; `initial_state` [B, H, K, V] is replicated and
    belongs to the first device's first document. Devices hold consecutive slices in
    `axis_name` order; T_local need not be a multiple of chunk_size. Returns (o_local,
    final state or None); the final state is the same on every device (shard it out with
    an unpartitioned spec).

    Two passes of `impl` over the local slice, so every impl (the Pallas kernels too)
    serves context parallelism and nothing per chunk is kept beyond what `impl` keeps:
      1. the segment's map h ↦ M h + N. The state's value columns evolve independently
         under the same linear update, so one pass with V + K value columns, v padded
         with K zero columns and the initial state [0 | I], ends in the state [N | M]
         (a final-state-only pass: `chunk` skips the outputs' work there);
      2. after the (M, N) pairs are all-gathered and prefix-combined, the outputs from
         this device's true incoming state.
    """
    from k3jax.ops import kda as kda_mod  # kda.py imports this module; avoid the cycle

    out_dtype = v.dtype
    # reset never marks the local t = 0 ...
    (q, k, v, g, beta), h0, reset, scale = kda_mod.prepare(q, k, v, g, beta, scale, initial_state,
                                                           segment_ids, impl, chunk_size,
                                                           gate_lower_bound)
    B, T, H, K = q.shape
    V = v.shape[-1]

    def run(v, h, outputs=True):
        return kda_mod.run_impl(impl, q, k, v, g, beta, h, reset, scale, chunk_size, outputs,
                                gate_lower_bound)

    idx = jax.lax.axis_index(axis_name)
    keep = jnp.ones((B,), jnp.float32)  # ... so a document starting there zeroes h instead
    if segment_ids is not None:
        # One id per row crosses the device boundary: the previous device's last one.
        last_ids = jax.lax.all_gather(segment_ids[:, -1], axis_name)  # [P, B]
        starts = (idx > 0) & (segment_ids[:, 0] != last_ids[jnp.maximum(idx - 1, 0)])
        keep = jnp.where(starts, 0.0, 1.0)
    keep = keep[:, None, None, None]

    eye = jnp.broadcast_to(jnp.eye(K, dtype=jnp.float32), (B, H, K, K)) * keep
    v_map = jnp.concatenate([v, jnp.zeros((B, T, H, K), jnp.float32)], axis=-1)
    _, nm = run(v_map, jnp.concatenate([jnp.zeros((B, H, K, V), jnp.float32), eye], -1),
                outputs=False)
    segment = (nm[..., V:], nm[..., :V])  # this device's whole map (M, N)

    # Exchange the fixed-size segment maps and prefix-combine them: every device learns
    # every device's outgoing state, and takes its predecessor's as its incoming one.
    gathered = jax.tree.map(lambda x: jax.lax.all_gather(x, axis_name), segment)  # [P, ...]
    prefix = jax.lax.associative_scan(compose, gathered, axis=0)
    after = _apply(prefix, h0[None])  # state after device p: [P, B, H, K, V]
    h_in = jnp.where(idx == 0, h0, after[jnp.maximum(idx - 1, 0)]) * keep

    o, _ = run(v, h_in)
    final = None
    if output_final_state:
        # after[-1] is the same on every device, but all_gather types it as varying over
        # the axis; one device's copy, psum'd, is typed replicated (shard_map's check then
        # takes an out spec without the axis), at the cost of one state-sized reduction.
        final = jax.lax.psum(jnp.where(idx == after.shape[0] - 1, after[-1], 0.0), axis_name)
    return o.astype(out_dtype), final


def sharded_kda(q, k, v, g, beta, *, spec, mesh=None, segment_ids=None, initial_state=None,
                output_final_state=False, impl="chunk", **kwargs):
    """`k3jax.ops.kda.kda` over a device mesh, each device on its own slice.

    spec = P(batch, length, heads): the mesh axes (or None) each of q's first three dims is
    split over; each must divide its dim. The recurrence is independent per sequence and
    head, so a device with a slice of batch and heads runs `kda` on it and nothing crosses
    devices. Where `length` is split too, the slices are consecutive pieces of time and
    context_parallel_kda exchanges only fixed-size state maps. Left to XLA's partitioner
    instead, the chunk loop's reshapes and the Pallas calls had it all-gather q, k, v and
    run the whole global batch and every head on every device.

    mesh: a Mesh, or None for the one in context (`jax.set_mesh`, or `sharding.use_mesh`).
    Other arguments are `kda`'s (initial_state [B, H, K, V] split like the heads). Returns
    (o split like v, final state or None).
    """
    from k3jax.ops import kda as kda_mod  # kda.py imports this module; avoid the cycle

    batch, length, heads = (tuple(spec) + (None,) * 3)[:3]
    per_head, per_state = P(batch, length, heads), P(batch, heads)  # [B, T, H, ·], [B, H, ·]

    def local(q, k, v, g, beta, segment_ids, initial_state):
        kw = dict(segment_ids=segment_ids, initial_state=initial_state,
                  output_final_state=output_final_state, impl=impl, **kwargs)
        if length is None:
            return kda_mod.kda(q, k, v, g, beta, **kw)
        return context_parallel_kda(q, k, v, g, beta, axis_name=length, **kw)

    # Pallas outputs carry no mesh-axis type, so shard_map's type check stays off for them.
    return jax.shard_map(local, mesh=mesh,
                         in_specs=(per_head,) * 5 + (P(batch, length), per_state),
                         out_specs=(per_head, per_state if output_final_state else None),
                         check_vma=impl != "pallas")(q, k, v, g, beta, segment_ids, initial_state)
