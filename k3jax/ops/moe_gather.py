"""Decode-time MoE dispatch: read only the experts the tokens chose.

A grouped matmul (`ragged`, `ep`) takes every expert's weights as an operand, so a decode
step with a handful of tokens is charged — and, where the kernel does not skip empty
groups, pays — the bytes of all of them. Here each device gathers just the distinct
experts its share of the (token, expert) pairs names, at most min(local experts, pairs)
of them, and multiplies every token with each gathered expert (a few tokens: the extra
FLOPs are nothing next to the weight reads a decode step is bound by); each token's output
is the routing-weighted sum over its own experts, fp32 as in the other dispatches.

MXFP4-resident experts are gathered as their uint8 codes and scales and only those
experts are widened; LoRA adapters are gathered with their experts and applied low rank,
scale · (z A_e) B_e. The mesh layout (experts and their hidden over the mesh axes the rules
give, one psum of the partial outputs, no all-to-all) is the caller's (`ops.moe_dispatch`). Meant for
decode (tokens × top-k well below the experts per device); for prefill and training,
`ragged` / `ep`.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from k3jax.config import EXPERT_ROLES
from k3jax.ops.mxfp4 import MXFP4, dequantize_experts

_HI = jax.lax.Precision.HIGHEST
_ROLES = EXPERT_ROLES


def _take(w, ids, dtype):
    """Experts `ids` of one weight as [m, in, out] in `dtype` (MXFP4: only these widened)."""
    if isinstance(w, MXFP4):
        return dequantize_experts(MXFP4(_rows(w.packed, ids), _rows(w.scale, ids)), dtype)
    return _rows(w, ids).astype(dtype)


# Up to this many experts are taken as one dynamic slice each (a decode step's few pairs);
# more as one gather, whose cost then no longer matters next to the step's other reads.
_SLICED_MAX = 64


def _rows(x, ids):
    """x[ids] along the experts axis. For a few ids, one dynamic slice each: compiling
    `x[ids]` for TPU, XLA re-laid the whole [E, in, out] stack out before gathering
    from it, reading every expert (more bytes than `ep`), and in scanned layers it
    first copied the layer's whole slice. A dynamic slice of the leading axis keeps the
    stack's layout and fuses with the layer's slice: only the chosen experts are read
    (`k3jax compile --mode decode`: docs/performance.md)."""
    if ids.shape[0] > _SLICED_MAX:
        return x[ids]
    return jnp.stack([jax.lax.dynamic_index_in_dim(x, ids[j], 0, keepdims=False) for j in range(ids.shape[0])])


def _base_product(x, w, ids, equation: str):
    """x times experts `ids` of w. For a few ids, one product per expert straight from its
    slice of the stack: stacking the slices into a [m, in, out] buffer first made XLA write
    and read them again (about 3x the expert bytes of a K3 decode step)."""
    dt = x.dtype
    if ids.shape[0] > _SLICED_MAX:
        return jnp.einsum(equation, x, _take(w, ids, dt))
    one = lambda j: _take(w, ids[j:j + 1], dt)[0]  # noqa: E731 — [in, out] of expert ids[j]
    if equation == "nh,mhf->nmf":
        return jnp.stack([x @ one(j) for j in range(ids.shape[0])], axis=1)
    return jnp.stack([x[:, j] @ one(j) for j in range(ids.shape[0])], axis=1)


def _product(x, w, adapter, scale: float, ids, equation: str):
    """x times the gathered experts `ids` of w (equation 'nh,mhf->nmf' or 'nmf,mfh->nmh'),
    plus the adapter's scale · (x A_e) B_e."""
    dt = x.dtype
    y = _base_product(x, w, ids, equation)
    if adapter is None:
        return y
    a, b = adapter
    per_token = equation.startswith("nm")
    if a.ndim == 2:   # 'shared_a': one A for every expert
        low = jnp.einsum("nmh,hr->nmr" if per_token else "nh,hr->nr", x, a.astype(dt),
                         preferred_element_type=jnp.float32).astype(dt)
        low = low if per_token else jnp.broadcast_to(low[:, None], (low.shape[0], ids.shape[0], low.shape[-1]))
    else:
        low = jnp.einsum("nmh,mhr->nmr" if per_token else "nh,mhr->nmr", x, a[ids].astype(dt),
                         preferred_element_type=jnp.float32).astype(dt)
    delta = jnp.einsum("nmr,mrf->nmf", low, b[ids].astype(dt), preferred_element_type=jnp.float32)
    return y + (scale * delta).astype(y.dtype)


def gather_local(act, n_local: int, expert_axes: tuple[str, ...], axes: tuple[str, ...], scales: dict,
                 z, idx, w, weights, adapters):
    """One device's share: experts [lo, lo + n_local) of weights w1 / w3 ([El, H, F] or
    MXFP4 [El, F, H/2]) and w2 ([El, F, H] or MXFP4 [El, H, F/2]), `lo` this device's
    place along the mesh axes `expert_axes` that split the experts; `axes` the mesh axes
    the partial outputs are summed over (those and the ones splitting the hidden).
    z [N, H], idx / w [N, k]; returns [N, H] fp32."""
    n, k = idx.shape
    lo = jax.lax.axis_index(expert_axes) * n_local if expert_axes else 0
    ids = idx - lo
    ids = jnp.where((ids >= 0) & (ids < n_local), ids, n_local).astype(jnp.int32)   # n_local: not here
    m = min(n_local, n * k)
    every = m > _SLICED_MAX and not any(isinstance(weights[r], MXFP4) for r in _ROLES)
    if every:       # every local expert: no ids, the stacks as they are
        picked, safe = jnp.arange(n_local), None
    else:
        picked = jnp.unique(ids.reshape(-1), size=m, fill_value=n_local)     # sorted; n_local pads
        safe = jnp.minimum(picked, n_local - 1)
    hit = (ids[:, :, None] == picked[None, None, :]) & (picked < n_local)[None, None, :]
    comb = jnp.sum(jnp.where(hit, w[:, :, None], 0.0), axis=1)                    # [n, m]
    if every:
        up = lambda r: _every_up(z, weights[r], adapters.get(r), scales.get(r, 0.0))  # noqa: E731
        y = _folded_w2(act(up("w1"), up("w3")), comb, weights["w2"], adapters.get("w2"), scales.get("w2", 0.0))
    else:
        mm = lambda x, r, eq: _product(x, weights[r], adapters.get(r), scales.get(r, 0.0), safe, eq)  # noqa: E731
        h = act(mm(z, "w1", "nh,mhf->nmf"), mm(z, "w3", "nh,mhf->nmf"))
        out = mm(h, "w2", "nmf,mfh->nmh")
        y = jnp.einsum("nm,nmh->nh", comb, out.astype(jnp.float32), precision=_HI)
    return jax.lax.psum(y, axes) if axes else y


# With more experts to take than are worth taking one by one (K3 at 32 sequences on
# v5p-256-decode: 512 pairs, about 390 distinct experts of 896 a layer), every local expert
# runs once, its rows outermost: h is [E, F, n] (the tokens innermost, as w2's rows want
# them), the routing weight folded into w2's contraction over (e, f), so no [n, E, H]
# product exists.
#
# Written as the einsums 'nh,ehf->nef' and 'nef,efh->nh', XLA:TPU made convolutions of
# them with the expert hidden F (24 columns a chip there) as the window, wanting F
# outermost: every scanned layer's expert stacks were copied out of their storage into
# that order first. In this form w1's and w3's are read where they lie; w2's contraction
# over (e, f) is still such a convolution and its stack still copied (docs/performance.md).


def _every_up(z, w, adapter, scale: float):
    """Every local expert of w [E, H, F] on every token z [n, H]: [E, F, n] (+ adapter)."""
    dt = z.dtype
    y = jnp.einsum("ehf,nh->efn", w.astype(dt), z)
    if adapter is None:
        return y
    a, b = adapter
    f32 = dict(preferred_element_type=jnp.float32)
    if a.ndim == 2:   # 'shared_a': one A for every expert
        low = jnp.einsum("nh,hr->rn", z, a.astype(dt), **f32).astype(dt)
        delta = jnp.einsum("rn,erf->efn", low, b.astype(dt), **f32)
    else:
        low = jnp.einsum("nh,ehr->ern", z, a.astype(dt), **f32).astype(dt)
        delta = jnp.einsum("ern,erf->efn", low, b.astype(dt), **f32)
    return y + (scale * delta).astype(y.dtype)


def _folded_w2(h, comb, w2, adapter, scale: float):
    """sum_e comb[n, e] · (h[e, :, n] w2_e (+ its adapter)) over every local expert, h
    [E, F, n], with the routing weight folded into the contraction over (e, f). The routing
    weight rounds with h once, as the other paths round each expert's output."""
    dt = h.dtype
    hc = (h.astype(jnp.float32) * comb.T[:, None, :]).astype(dt)                    # [El, F, n]
    f32 = dict(preferred_element_type=jnp.float32)
    y = jnp.einsum("efn,efh->nh", hc, w2.astype(dt), **f32)
    if adapter is None:
        return y
    a, b = adapter
    low = (jnp.einsum("efn,fr->ern", hc, a.astype(dt), **f32) if a.ndim == 2
           else jnp.einsum("efn,efr->ern", hc, a.astype(dt), **f32))
    return y + scale * jnp.einsum("ern,erh->nh", low.astype(dt), b.astype(dt), **f32)
