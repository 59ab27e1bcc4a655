"""Decode-time MoE dispatch: read only the experts the tokens chose.

A grouped matmul (`ragged`, `ep`) takes every expert's weights as an operand, so a decode
step with a handful of tokens is charged — and, where the kernel does not skip empty
groups, pays — the bytes of all of them. Here each device gathers just the distinct
experts its share of the (token, expert) pairs names, at most min(local experts, pairs)
of them, and multiplies every token with each gathered expert (a few tokens: the extra
FLOPs are nothing next to the weight reads a decode step is bound by); each token's output
is the routing-weighted sum over its own experts, fp32 as in the other dispatches.

Under a mesh the experts stay where they live (split over `expert`, their hidden over
`tensor`), the few tokens are replicated to every device, and one psum of [tokens, hidden]
fp32 joins the partial outputs; no all-to-all. Meant for decode (tokens × top-k well below
the experts per device); for prefill and training, `ragged` / `ep`.
"""
from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

_HI = jax.lax.Precision.HIGHEST


def _local(act, n_local: int, axes: tuple[str, ...], z, idx, w, w1, w2, w3):
    """One device: experts [lo, lo + n_local) of w1/w3 [El, H, F], w2 [El, F, H]."""
    n, k = idx.shape
    lo = jax.lax.axis_index("expert") * n_local if "expert" in axes else 0
    ids = idx - lo
    ids = jnp.where((ids >= 0) & (ids < n_local), ids, n_local).astype(jnp.int32)   # n_local: not here
    m = min(n_local, n * k)
    picked = jnp.unique(ids.reshape(-1), size=m, fill_value=n_local)     # sorted; n_local pads
    safe = jnp.minimum(picked, n_local - 1)
    g = jnp.einsum("nh,mhf->nmf", z, w1[safe])
    u = jnp.einsum("nh,mhf->nmf", z, w3[safe])
    out = jnp.einsum("nmf,mfh->nmh", act(g, u), w2[safe])
    hit = (ids[:, :, None] == picked[None, None, :]) & (picked < n_local)[None, None, :]
    comb = jnp.sum(jnp.where(hit, w[:, :, None], 0.0), axis=1)                    # [n, m]
    y = jnp.einsum("nm,nmh->nh", comb, out.astype(jnp.float32), precision=_HI)
    return jax.lax.psum(y, axes) if axes else y


def experts_gather(z, idx, w, w1, w2, w3, *, act):
    """z [N, H] tokens, idx / w [N, k] their experts and routing weights, w1 / w3 [E, H, F]
    and w2 [E, F, H] the experts, `act(g, u)` the gated activation. Returns [N, H] fp32."""
    mesh = jax.sharding.get_abstract_mesh()
    sizes = {} if mesh.empty else dict(mesh.shape)
    E, F = w1.shape[0], w1.shape[-1]
    ex = "expert" if sizes.get("expert", 1) > 1 and E % sizes["expert"] == 0 else None
    tensor = "tensor" if sizes.get("tensor", 1) > 1 and F % sizes["tensor"] == 0 else None
    axes = tuple(a for a in (ex, tensor) if a)
    if not axes:
        return _local(act, E, (), z, idx, w, w1, w2, w3)
    w_in, w_out = P(ex, None, tensor), P(ex, tensor, None)
    fn = jax.shard_map(functools.partial(_local, act, E // math.prod(sizes[a] for a in (ex,) if a), axes),
                       in_specs=(P(), P(), P(), w_in, w_out, w_in), out_specs=P())
    return fn(z, idx, w, w1, w2, w3)
