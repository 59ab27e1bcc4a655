"""Quantization-aware fine-tuning (`qat: true`): routed experts seen as the export stores them.

The export (k3jax.checkpoint.export) writes each routed expert as MXFP4 of its merged value,
mxfp4(W + (alpha/r)·A·B) with fresh OCP scales (compressed-tensors' rounding). Under QAT the
forward multiplies by exactly those values, so the export loses nothing of what was trained:

- MXFP4-resident base with adapters: the fused grouped matmul merges and re-quantizes each
  block (pure path) or tile (Mosaic and Triton kernels) it decodes (`mxfp4_grouped_matmul(merge=...)`);
  no widened or merged copy of the stack exists.
- widened base (bf16/fp32 experts; full fine-tuning, or LoRA over them): each expert's
  merged value is quantized to MXFP4 bytes one expert at a time (17/32 byte per value, the
  only per-layer copy), then the same fused product runs on those bytes.

Gradients are straight-through: the rounding counts as the identity, so W, A and B get the
gradients of the unquantized product (rows @ (W + s·A·B)), the plain path's. For the
adapters that is the low-rank path's own gradient (xᵀ·ct through A and B), so no per-expert
dW is formed; rows get the exact gradient of the quantized product (ct @ Qᵀ, the fused
kernel in the other orientation). Merging is one rank at a time in fp32 and quantizing is
bit for bit the exporter's (pallas_kernels.mxfp4_gmm.encode; tests/ops/test_qat.py).
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from k3jax.ops.mxfp4 import MXFP4, dequantize_experts
from pallas_kernels.mxfp4_gmm import encode as enc


def round_bf16(x):
    """x (fp32) rounded to the nearest bf16 (ties to even), still fp32: the export's cast.
    On the bits, not by a cast pair: XLA drops an fp32 -> bf16 -> fp32 round trip as excess
    precision (xla_allow_excess_precision) where its fusion allows, so a convert pair would
    round in some programs and not in others."""
    bits = jax.lax.bitcast_convert_type(x.astype(jnp.float32), jnp.uint32)
    bits = (bits + jnp.uint32(0x7FFF) + ((bits >> 16) & 1)) & jnp.uint32(0xFFFF0000)
    return jax.lax.bitcast_convert_type(bits, jnp.float32)


def merged_bf16(kernel, a, b, scale: float):
    """bf16(W + scale·A·B) (as fp32 values) of a projection's kernel [in, out] and adapters
    A [in, r], B [r, out]: the released value of a merged projection (the exporter merges
    with the same fp32 operations, k3jax.checkpoint.update_loss.merged_fp32, then casts)."""
    return round_bf16(enc.merge(kernel, a, b, scale))


def merged_oi(w, adapter, scale: float, e=None):
    """One expert's (or, e None, every expert's) merged weight [.., out, in] in fp32:
    W + scale·(A B)ᵀ, one rank at a time (encode.merge). w: [E, in, out] widened."""
    w_oi = jnp.swapaxes(w if e is None else w[e], -1, -2)
    if adapter is None:
        return w_oi.astype(jnp.float32)
    a, b = adapter
    if e is not None:
        a, b = (a if a.ndim == 2 else a[e]), b[e]
    elif a.ndim == 2:
        a = jnp.broadcast_to(a, (b.shape[0], *a.shape))
    return enc.merge(w_oi, jnp.swapaxes(b, -1, -2), jnp.swapaxes(a, -1, -2), scale)


def quantize_oi(w):
    """fp32 [..., out, in] -> (packed [..., out, in/2], scale [..., out, in/32]) uint8: the
    exporter's bytes (quantize_mxfp4 of the same fp32 values)."""
    *lead, n, k = w.shape
    g = w.reshape(*lead, n, k // 32, 32)
    s = enc.scale_bytes(jnp.max(jnp.abs(g), axis=-1))
    c = enc.codes(g, s[..., None]).reshape(*lead, n, k // 2, 2)
    return (c[..., 0] | (c[..., 1] << 4)).astype(jnp.uint8), s.astype(jnp.uint8)


def requantized(w, adapter, scale: float) -> MXFP4:
    """MXFP4 bytes of every expert's merged weight, computed one expert at a time (the
    bytes are the only stack formed), no gradient. w: MXFP4 or [E, in, out]."""
    w, adapter = jax.lax.stop_gradient((w, adapter))
    if isinstance(w, MXFP4):
        if adapter is None:
            return w
        widened = lambda e: dequantize_experts(MXFP4(w.packed[e][None], w.scale[e][None]), jnp.float32)[0]  # noqa: E731
        n = w.packed.shape[0]
    else:
        widened = lambda e: w[e]  # noqa: E731
        n = w.shape[0]

    def one(e):
        ad = None if adapter is None else (adapter[0] if adapter[0].ndim == 2 else adapter[0][e][None],
                                           adapter[1][e][None])
        return quantize_oi(merged_oi(widened(e)[None], ad, scale)[0])

    packed, sc = jax.lax.map(one, jnp.arange(n))
    return MXFP4(packed, sc)


def _lowrank(rows, adapter, sizes, scale, expected_rows):
    from k3jax.ops.experts import lowrank_product
    return lowrank_product(rows, adapter, sizes, scale, expected_rows)


def expert_matmul_qat(rows, w, sizes, adapter=None, scale: float = 0.0, expected_rows=None):
    """`expert_matmul` with every expert's weight mxfp4(W + scale·A·B) (module doc)."""
    from k3jax.ops.mxfp4_matmul import mxfp4_grouped_matmul
    if isinstance(w, MXFP4):
        if adapter is None:     # the stored bytes are already what the export writes
            return mxfp4_grouped_matmul(rows, w.packed, w.scale, sizes, expected_rows=expected_rows)
        y = mxfp4_grouped_matmul(rows, w.packed, w.scale, sizes, expected_rows=expected_rows,
                                 merge=(*adapter, scale))
        # zero in value, the adapters' straight-through gradient (the low-rank path's) in the
        # backward; rows get theirs from the product above alone
        t = _lowrank(jax.lax.stop_gradient(rows), adapter, sizes, scale, expected_rows)
        return y + (t - jax.lax.stop_gradient(t)).astype(y.dtype)
    return _widened((float(scale), expected_rows), rows, w, adapter, jnp.asarray(sizes, jnp.int32))


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _widened(opts, rows, w, adapter, sizes):
    from k3jax.ops.mxfp4_matmul import mxfp4_grouped_matmul
    scale, expected = opts
    q = requantized(w, adapter, scale)
    return mxfp4_grouped_matmul(rows, q.packed, q.scale, sizes, expected_rows=expected)


def _widened_fwd(opts, rows, w, adapter, sizes):
    # the bytes are recomputed in the backward: one pass over the layer's experts, rather
    # than 17/32 byte per expert value kept for every layer until then
    return _widened(opts, rows, w, adapter, sizes), (rows, w, adapter, sizes)


def _widened_bwd(opts, res, ct):
    from k3jax.ops.experts import expert_matmul
    from k3jax.ops.mxfp4_matmul import mxfp4_grouped_matmul
    scale, expected = opts
    rows, w, adapter, sizes = res
    q = requantized(w, adapter, scale)
    dx = mxfp4_grouped_matmul(ct, q.packed, q.scale, sizes, transpose_rhs=False, expected_rows=expected)
    # straight through: W's and the adapters' gradients are the unquantized product's
    _, vjp = jax.vjp(lambda w_, ad: expert_matmul(rows, w_.astype(rows.dtype), sizes, ad, scale, expected),
                     w, adapter)
    dw, dad = vjp(ct.astype(rows.dtype))
    return dx, dw, dad, np.zeros(sizes.shape, jax.dtypes.float0)


_widened.defvjp(_widened_fwd, _widened_bwd)


@jax.custom_vjp
def straight_through(x, q):
    """q in the forward, the identity to x in the backward (q: a rounding of x)."""
    return q


straight_through.defvjp(lambda x, q: (q, None), lambda _, ct: (ct, jnp.zeros_like(ct)))


def dense_stack(w, adapter, scale: float, dtype):
    """The `dense` oracle's [E, in, out] under QAT: every expert's mxfp4(W + scale·A·B),
    widened whole (small configs), gradients straight through to W, A and B."""
    widened = dequantize_experts(w, jnp.float32) if isinstance(w, MXFP4) else w
    merged = merged_oi(widened, adapter, scale)
    p, s = quantize_oi(jax.lax.stop_gradient(merged))
    q = jnp.swapaxes(dequantize_experts(MXFP4(p, s), jnp.float32), -1, -2)
    return jnp.swapaxes(straight_through(merged, q), -1, -2).astype(dtype)
