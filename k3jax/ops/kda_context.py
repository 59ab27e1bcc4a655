"""KDA over a device mesh (SPEC.md §3): context parallelism through segment maps.

- `context_parallel_kda`: called inside `jax.shard_map` with the time axis split over a
  mesh axis; each device reduces its segment to one affine map (M, N) (kda_assoc.py) with
  a pass of any impl, the fixed-size maps are all-gathered and prefix-combined, and each
  device finishes from its true incoming state. Communication is O(K·(K+V)) per head and
  device, independent of the sequence length.
- `sharded_kda`: `kda` over a device mesh from outside any shard_map, each device its own
  slice of batch and heads (and of time, through context_parallel_kda).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from k3jax.ops import kda as kda_mod
from k3jax.ops.kda_assoc import apply, compose


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
    impl="auto",
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
    out_dtype = v.dtype
    impl = kda_mod.resolve_impl(impl, q.shape[1], q.shape[-1])   # the local slice's length
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
    after = apply(prefix, h0[None])  # state after device p: [P, B, H, K, V]
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
                output_final_state=False, impl="auto", **kwargs):
    """`k3jax.ops.kda.kda` over a device mesh, each device on its own slice.

    spec = P(batch, length, heads): the mesh axes (or None) each of q's first three dims is
    split over; each must divide its dim. The recurrence is independent per sequence and
    head, so a device with a slice of batch and heads runs `kda` on it and nothing crosses
    devices. Where `length` is split too, the slices are consecutive pieces of time and
    context_parallel_kda exchanges only fixed-size state maps. Left to XLA's partitioner
    instead, the chunk loop's reshapes and the Pallas calls had it all-gather q, k, v and
    run the whole global batch and every head on every device.

    mesh: a Mesh, or None for the one in context (`jax.set_mesh`, or `k3jax.mesh.use_mesh`).
    Other arguments are `kda`'s (initial_state [B, H, K, V] split like the heads). Returns
    (o split like v, final state or None).
    """
    batch, length, heads = (tuple(spec) + (None,) * 3)[:3]
    impl = kda_mod.resolve_impl(impl, q.shape[1], q.shape[-1])   # one choice for every device
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
