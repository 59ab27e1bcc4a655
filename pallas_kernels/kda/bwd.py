"""Backward Pallas kernel of the KDA state recurrence (the sequential part).

Per chunk, forward: V' = U − W h;  O = Q̃ h + P V';  h⁺ = e^{G_C} ⊙ h + K̃ᵀ V'.
Walking the chunks in reverse with dh⁺ (the cotangent of the outgoing state):
  dV' = Pᵀ dO + K̃ dh⁺,  dQ̃ = dO hᵀ,  dP = dO V'ᵀ,  dK̃ = V' dh⁺ᵀ,  d e^{G_C} = Σ_v h ⊙ dh⁺,
  dU = dV',  dW = −dV' hᵀ,  dh = Q̃ᵀ dO + e^{G_C} ⊙ dh⁺ − Wᵀ dV'.
The incoming states h come from the forward kernel, so nothing is recomputed serially.
Layouts (stream on TPU, loop on GPU) and portability rules as in fwd.py.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels.kda.fwd import (call_options, default_layout, dot, dot_nt, dot_tn,
                                    kernel_call, stream_call_options)


def chunk_step_bwd(qd, p, w, u, kt, dec, h, do, dh):
    """Cotangents of one chunk (see the module docstring): returns
    (dQ̃, dP, dW, dU, dK̃, d e^{G_C}, dh_in)."""
    v_new = u - dot(w, h)
    dv_new = dot_tn(p, do) + dot(kt, dh)
    dh_in = dot_tn(qd, do) + dec * dh - dot_tn(w, dv_new)
    return (dot_nt(do, h), dot_nt(do, v_new), -dot_nt(dv_new, h), dv_new, dot_nt(v_new, dh),
            jnp.sum(h * dh, axis=1, keepdims=True), dh_in)


def _recurrence_bwd_loop_kernel(qd_ref, p_ref, w_ref, u_ref, kt_ref, dec_ref, hs_ref, do_ref,
                                dht_ref, dqd_ref, dp_ref, dw_ref, du_ref, dkt_ref, ddec_ref,
                                dh0_ref, *, chunk_size):
    C = chunk_size
    K = dht_ref.shape[0]
    N = qd_ref.shape[0] // C

    def chunk(i, dh):
        n = N - 1 - i
        t = pl.multiple_of(n * C, C)
        s = pl.multiple_of(n * K, K)
        tok = lambda r: r[pl.ds(t, C), :]  # noqa: E731
        *d_tok, d_dec, dh = chunk_step_bwd(
            tok(qd_ref), tok(p_ref), tok(w_ref), tok(u_ref), tok(kt_ref),
            dec_ref[pl.ds(s, K), :], hs_ref[pl.ds(s, K), :], tok(do_ref), dh)
        for ref, d in zip((dqd_ref, dp_ref, dw_ref, du_ref, dkt_ref), d_tok):
            ref[pl.ds(t, C), :] = d
        ddec_ref[pl.ds(s, K), :] = d_dec
        return dh

    dh0_ref[...] = jax.lax.fori_loop(0, N, chunk, dht_ref[...])


def _recurrence_bwd_stream_kernel(qd_ref, p_ref, w_ref, u_ref, kt_ref, dec_ref, hs_ref, do_ref,
                                  dht_ref, dqd_ref, dp_ref, dw_ref, du_ref, dkt_ref, ddec_ref,
                                  dh0_ref, dh_scr):
    """Grid (Z, N) whose index maps visit the chunks last to first; dh in VMEM scratch."""
    i = pl.program_id(1)

    @pl.when(i == 0)
    def _():
        dh_scr[...] = dht_ref[...]

    *d_tok, d_dec, dh = chunk_step_bwd(qd_ref[...], p_ref[...], w_ref[...], u_ref[...],
                                       kt_ref[...], dec_ref[...], hs_ref[...], do_ref[...],
                                       dh_scr[...])
    for ref, d in zip((dqd_ref, dp_ref, dw_ref, du_ref, dkt_ref), d_tok):
        ref[...] = d
    ddec_ref[...] = d_dec
    dh_scr[...] = dh

    @pl.when(i == pl.num_programs(1) - 1)
    def _():
        dh0_ref[...] = dh


def recurrence_bwd(qd, p, w, u, kt, dec, hs, do, dht, *, chunk_size, mode, layout=None):
    """Cotangents of (Q̃, P, W, U, K̃, decay) and of the initial state, same layouts."""
    Z, Tp, K = qd.shape
    V = u.shape[-1]
    C = chunk_size
    N = Tp // C
    sds = lambda *d: jax.ShapeDtypeStruct((Z, *d), jnp.float32)  # noqa: E731
    shapes = [(Tp, K), (Tp, C), (Tp, K), (Tp, V), (Tp, K), (N * K, 1)]
    out_shape = [sds(*d) for d in shapes] + [sds(K, V)]
    args = (qd, p, w, u, kt, dec, hs, do, dht)
    if (layout or default_layout(mode)) == "loop":
        whole = lambda *d: pl.BlockSpec((None, *d), lambda z: (z,) + (0,) * len(d))  # noqa: E731
        return kernel_call(
            mode, functools.partial(_recurrence_bwd_loop_kernel, chunk_size=C),
            grid=(Z,),
            in_specs=[whole(*d) for d in shapes] + [whole(N * K, V), whole(Tp, V), whole(K, V)],
            out_specs=[whole(*d) for d in shapes] + [whole(K, V)],
            out_shape=out_shape,
            name="kda_recurrence_bwd",
            **call_options(mode, 1),
        )(*args)
    rev = lambda r, d: pl.BlockSpec((None, r, d), lambda z, i: (z, N - 1 - i, 0))  # noqa: E731
    per_z = lambda r, d: pl.BlockSpec((None, r, d), lambda z, i: (z, 0, 0))  # noqa: E731
    blocks = [rev(C, K), rev(C, C), rev(C, K), rev(C, V), rev(C, K), rev(K, 1)]
    return kernel_call(
        mode, _recurrence_bwd_stream_kernel,
        grid=(Z, N),
        in_specs=blocks + [rev(K, V), rev(C, V), per_z(K, V)],
        out_specs=blocks + [per_z(K, V)],
        out_shape=out_shape,
        scratch_shapes=[pltpu.VMEM((K, V), jnp.float32)],
        name="kda_recurrence_bwd",
        **stream_call_options(mode),
    )(*args)
