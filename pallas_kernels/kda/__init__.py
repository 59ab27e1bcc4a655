"""KDA with Pallas kernels, joined into one differentiable function by `jax.custom_vjp`.

Forward: `fwd.chunk_terms` (the intra-chunk factorisation, parallel over chunks) then
`fwd.recurrence` (state propagation and outputs). Backward: the chunk terms are
recomputed by `fwd.chunk_terms`, `bwd.recurrence_bwd` walks the chunks in reverse for
their cotangents and that of h0, and `bwd_terms.chunk_terms_bwd` (parallel over chunks)
pulls those back to q, k, v, g, β.

Inputs follow k3jax.ops.kda_chunk: fp32, q pre-scaled, `reset` [B, T] bool. Kernels run
in interpret mode on CPU and are compiled with Mosaic on TPU and Triton on GPU: with
mode="auto" each kernel call is a `jax.lax.platform_dependent` over the three, so the
choice is made per lowering platform (one jitted function serves CPU tests and exports
for TPU and CUDA alike).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from pallas_kernels.kda_blocks import score_leaf
from pallas_kernels.kda import bwd, bwd_terms, fwd

SUB = fwd.SUB


MODES = ("auto",) + fwd.MODES


def _run(fn, *args, mode, **kw):
    if mode != "auto":
        return fn(*args, mode=mode, **kw)
    per = lambda m: functools.partial(fn, mode=m, **kw)  # noqa: E731
    return jax.lax.platform_dependent(*args, tpu=per("tpu"), cuda=per("triton"),
                                      rocm=per("triton"), default=per("interpret"))


def _to_kernel(x, t_pad):
    """[B, T, H, D] -> [B·H, T_pad, D], zero-padded (a padded token is the identity map)."""
    B, T, H, D = x.shape
    x = jnp.pad(x, [(0, 0), (0, t_pad - T), (0, 0), (0, 0)])
    return jnp.transpose(x, (0, 2, 1, 3)).reshape(B * H, t_pad, D)


def _from_kernel(x, B, T):
    Z, t_pad, D = x.shape
    return jnp.transpose(x.reshape(B, Z // B, t_pad, D), (0, 2, 1, 3))[:, :T]


def _masks(reset, n_chunks, chunk_size):
    """Document structure per chunk, prepared outside the kernels (float 0/1):
    same [B, Tp, C] (token i and chunk column j share a document), sees_in [B, Tp, 1] (no
    document start since the chunk began), reaches_out [B, Tp, 1] (none after it)."""
    B, T = reset.shape
    r = jnp.pad(reset, [(0, 0), (0, n_chunks * chunk_size - T)])
    r = jnp.cumsum(r.reshape(B, n_chunks, chunk_size).astype(jnp.int32), axis=-1)
    same = (r[..., :, None] == r[..., None, :]).reshape(B, -1, chunk_size)
    sees_in = (r == 0).reshape(B, -1, 1)
    reaches_out = (r == r[..., -1:]).reshape(B, -1, 1)
    return tuple(m.astype(jnp.float32) for m in (same, sees_in, reaches_out))


def _forward(q, k, v, g, beta, h0, reset, chunk_size, mode, layout, bounded):
    B, T, H, K = q.shape
    n_chunks = max(1, -(-T // chunk_size))
    t_pad = n_chunks * chunk_size
    ins = [_to_kernel(x, t_pad) for x in (q, k, v, g, beta[..., None])]
    terms = _run(fwd.chunk_terms, *ins, *_masks(reset, n_chunks, chunk_size), heads=H,
                 chunk_size=chunk_size, mode=mode, bounded=bounded)
    h0z = h0.reshape(B * H, K, v.shape[-1])
    o, hs, ht = _run(fwd.recurrence, *terms, h0z, chunk_size=chunk_size, mode=mode, layout=layout)
    return _from_kernel(o, B, T), ht.reshape(h0.shape), hs


@functools.partial(jax.custom_vjp, nondiff_argnums=(7, 8, 9, 10))
def _kda(q, k, v, g, beta, h0, reset, chunk_size, mode, layout, bounded):
    o, ht, _ = _forward(q, k, v, g, beta, h0, reset, chunk_size, mode, layout, bounded)
    return o, ht


def _kda_fwd(q, k, v, g, beta, h0, reset, chunk_size, mode, layout, bounded):
    o, ht, hs = _forward(q, k, v, g, beta, h0, reset, chunk_size, mode, layout, bounded)
    return (o, ht), (q, k, v, g, beta, reset, hs)


def _kda_bwd(chunk_size, mode, layout, bounded, res, cts):
    q, k, v, g, beta, reset, hs = res
    do, dht = cts
    B, T, H, K = q.shape
    V = v.shape[-1]
    n_chunks = hs.shape[1] // K
    t_pad = n_chunks * chunk_size
    ins = [_to_kernel(x, t_pad) for x in (q, k, v, g, beta[..., None])]
    masks = _masks(reset > 0, n_chunks, chunk_size)
    # The chunk terms are recomputed (parallel over chunks) rather than kept from the forward.
    terms = _run(fwd.chunk_terms, *ins, *masks, heads=H, chunk_size=chunk_size, mode=mode,
                 bounded=bounded)
    d_terms = _run(bwd.recurrence_bwd, *terms, hs, _to_kernel(do.astype(jnp.float32), t_pad),
                   dht.reshape(B * H, K, V), chunk_size=chunk_size, mode=mode, layout=layout)
    *d_terms, dh0 = d_terms
    dq, dk, dv, dg, dbeta = _run(bwd_terms.chunk_terms_bwd, *ins, *masks, *d_terms, heads=H,
                                 chunk_size=chunk_size, mode=mode, bounded=bounded)
    d_in = [_from_kernel(x, B, T) for x in (dq, dk, dv, dg, dbeta)]
    d_in[4] = d_in[4][..., 0]
    return (*d_in, dh0.reshape(B, H, K, V), jnp.zeros_like(reset))


_kda.defvjp(_kda_fwd, _kda_bwd)


def pallas_kda(q, k, v, g, beta, initial_state, reset, chunk_size, mode="auto", layout=None,
               gate_lower_bound=None):
    """KDA through the Pallas kernels. fp32 in and out; returns (o [B,T,H,V], final state).

    chunk_size must be a multiple of 16 and a power of two (Triton block shapes).
    gate_lower_bound: as for k3jax.ops.kda.kda; where it is tight enough for a 16-token
    sub-chunk (K3's -5), its diagonal score blocks take one matmul each, forward and
    backward, instead of 16 column steps.
    mode: "auto" (interpret on CPU, Mosaic on TPU, Triton on GPU, decided per lowering
    platform), or one of "interpret", "tpu", "triton" to force it.
    layout: the state loop's kernel layout, "stream" or "loop"; None picks per mode
    (fwd.default_layout). Interpret mode runs either, so CPU tests cover both.
    """
    if mode not in MODES:
        raise ValueError(f"kda(impl='pallas'): unknown mode {mode!r}; expected one of {MODES}")
    if layout not in (None, "stream", "loop"):
        raise ValueError(f"kda(impl='pallas'): unknown layout {layout!r}; expected 'stream' or 'loop'")
    if chunk_size % SUB or chunk_size & (chunk_size - 1):
        raise ValueError(f"kda(impl='pallas'): chunk_size must be a power of two and a multiple "
                         f"of {SUB}, got {chunk_size}")
    K, V = q.shape[-1], v.shape[-1]
    Kp, Vp = _kernel_dim(K), _kernel_dim(V)
    if (Kp, Vp) != (K, V):
        # Zero channels are exact: a zero k column never writes the state, a zero q column
        # never reads it, g = 0 keeps the (zero) padded rows as they are, and a zero v
        # column stays zero in the state and the output. Gradients flow through the pads.
        def widen(x, axis, n):  # zero-pad `axis` by n at the end
            widths = [(0, 0)] * x.ndim
            widths[axis] = (0, n)
            return jnp.pad(x, widths)

        q, k, g = (widen(x, -1, Kp - K) for x in (q, k, g))
        v = widen(v, -1, Vp - V)
        initial_state = widen(widen(initial_state, -1, Vp - V), -2, Kp - K)
    reset = jnp.asarray(reset, jnp.float32)  # a float so custom_vjp can give it a zero cotangent
    bounded = score_leaf(gate_lower_bound, SUB) >= SUB
    o, h = _kda(q, k, v, g, beta, initial_state, reset, chunk_size, mode, layout, bounded)
    return o[..., :V], h[..., :K, :V]


def _kernel_dim(d):
    """The head dim the kernels run at: the next power of two, at least 16 (Triton block
    shapes and the 16-wide sub-chunks want both)."""
    return max(16, 1 << (d - 1).bit_length())
