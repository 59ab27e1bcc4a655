"""Backward Pallas kernel of the KDA state recurrence (the sequential part).

Per chunk, forward: V' = U − W h;  O = Q̃ h + P V';  h⁺ = e^{G_C} ⊙ h + K̃ᵀ V'.
Walking the chunks in reverse with dh⁺ (the cotangent of the outgoing state):
  dV' = Pᵀ dO + K̃ dh⁺,  dQ̃ = dO hᵀ,  dP = dO V'ᵀ,  dK̃ = V' dh⁺ᵀ,  d e^{G_C} = Σ_v h ⊙ dh⁺,
  dU = dV',  dW = −dV' hᵀ,  dh = Q̃ᵀ dO + e^{G_C} ⊙ dh⁺ − Wᵀ dV'.
The incoming states h come from the forward kernel, so nothing is recomputed serially.
Layout and portability rules as in fwd.py.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels.kda.fwd import call_options, dot, dot_nt, dot_tn


def _recurrence_bwd_kernel(qd_ref, p_ref, w_ref, u_ref, kt_ref, dec_ref, hs_ref, do_ref, dht_ref,
                           dqd_ref, dp_ref, dw_ref, du_ref, dkt_ref, ddec_ref, dh0_ref,
                           *, chunk_size):
    C = chunk_size
    K = dht_ref.shape[0]
    N = qd_ref.shape[0] // C

    def chunk(i, dh):
        n = N - 1 - i
        t = pl.multiple_of(n * C, C)
        s = pl.multiple_of(n * K, K)
        h = hs_ref[pl.ds(s, K), :]
        w = w_ref[pl.ds(t, C), :]
        do = do_ref[pl.ds(t, C), :]
        v_new = u_ref[pl.ds(t, C), :] - dot(w, h)
        dv_new = dot_tn(p_ref[pl.ds(t, C), :], do) + dot(kt_ref[pl.ds(t, C), :], dh)
        dqd_ref[pl.ds(t, C), :] = dot_nt(do, h)
        dp_ref[pl.ds(t, C), :] = dot_nt(do, v_new)
        dkt_ref[pl.ds(t, C), :] = dot_nt(v_new, dh)
        du_ref[pl.ds(t, C), :] = dv_new
        dw_ref[pl.ds(t, C), :] = -dot_nt(dv_new, h)
        dec = dec_ref[pl.ds(s, K), :]
        ddec_ref[pl.ds(s, K), :] = jnp.sum(h * dh, axis=1, keepdims=True)
        return dot_tn(qd_ref[pl.ds(t, C), :], do) + dec * dh - dot_tn(w, dv_new)

    dh0_ref[...] = jax.lax.fori_loop(0, N, chunk, dht_ref[...])


def recurrence_bwd(qd, p, w, u, kt, dec, hs, do, dht, *, chunk_size, mode):
    """Cotangents of (Q̃, P, W, U, K̃, decay) and of the initial state, same layouts."""
    Z, Tp, K = qd.shape
    V = u.shape[-1]
    N = Tp // chunk_size
    whole = lambda *d: pl.BlockSpec((None, *d), lambda z: (z,) + (0,) * len(d))  # noqa: E731
    sds = lambda *d: jax.ShapeDtypeStruct((Z, *d), jnp.float32)  # noqa: E731
    shapes = [(Tp, K), (Tp, chunk_size), (Tp, K), (Tp, V), (Tp, K), (N * K, 1)]
    return pl.pallas_call(
        functools.partial(_recurrence_bwd_kernel, chunk_size=chunk_size),
        grid=(Z,),
        in_specs=[whole(*d) for d in shapes] + [whole(N * K, V), whole(Tp, V), whole(K, V)],
        out_specs=[whole(*d) for d in shapes] + [whole(K, V)],
        out_shape=[sds(*d) for d in shapes] + [sds(K, V)],
        name="kda_recurrence_bwd",
        **call_options(mode, 1),
    )(qd, p, w, u, kt, dec, hs, do, dht)
