"""E2M1 codes under E8M0 scales to floats, on int32 arrays of any shape.

One helper for the pure-JAX grouped matmul (k3jax.ops.mxfp4_matmul) and for the Pallas
kernels beside it, which may not import k3jax.checkpoint: only integer arithmetic, selects
and one same-width bitcast, so it lowers inside Mosaic and Triton kernels as well as in
XLA. The values are those of k3jax.checkpoint.mxfp4.dequantize_mxfp4, bit for bit
(tests/ops/test_mxfp4_gmm.py checks every code under every scale byte).

A code c (bit 3 the sign, bits 0..2 an index i) is E2M1 with exponent field i >> 1 and
mantissa bit i & 1: 0, 0.5, 1, 1.5, 2, 3, 4, 6. Its product with 2**(s - 127) is built
directly as fp32 bits: biased exponent s + e (e the code's own unbiased exponent, -1..2)
over the code's mantissa bit. Building the bits rather than multiplying keeps the
results that fall below fp32's normal range (scale bytes 0 and 1), which arithmetic on
XLA:CPU and TPU would flush to zero; biased exponents past 254 are inf, and s = 255 is
NaN (OCP MX).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

E8M0_NAN = 255


def e2m1_e8m0_bits(code, scale):
    """fp32 bit patterns (int32) of code · 2**(scale − 127); code in 0..15 and scale in
    0..255, int32 arrays that broadcast together."""
    i32 = jnp.int32
    idx = code & 7
    big = idx >= 2                                  # exponent field >= 1: a normal E2M1 value
    e = jnp.where(big, (idx >> 1) - 1, -1)          # unbiased exponent; 0.5 = 2**-1
    m = jnp.where(big, idx & 1, 0)                  # the one mantissa bit
    b = scale + e                                   # biased fp32 exponent of the product
    normal = (b << 23) | (m << 22)
    # Below fp32's normal range (b = 0 or -1) the implicit one moves into the mantissa;
    # at most two bits are set there, and the shift (1 or 2) drops neither.
    sub = ((m << 22) | (1 << 23)) >> jnp.clip(1 - b, 0, 31)
    mag = jnp.where(b >= 255, i32(0x7F80_0000), jnp.where(b >= 1, normal, sub))
    mag = jnp.where(idx == 0, i32(0), mag)
    # The sign is bit 31 of an int32: subtracting 2**31 from a non-negative magnitude
    # sets it without a shift into the sign bit.
    bits = jnp.where((code & 8) != 0, mag + i32(-(2**31)), mag)
    return jnp.where(scale == E8M0_NAN, i32(0x7FC0_0000), bits)


def e2m1_e8m0(code, scale, dtype=jnp.float32):
    """code · 2**(scale − 127) in `dtype` (bf16 or fp32: exact, one conversion from fp32,
    which keeps subnormals and infinities)."""
    bits = e2m1_e8m0_bits(code.astype(jnp.int32), scale.astype(jnp.int32))
    return jax.lax.bitcast_convert_type(bits, jnp.float32).astype(dtype)


def nibbles(packed):
    """(low, high) nibbles of packed bytes as int32: the codes of elements 2j and 2j+1."""
    p = packed.astype(jnp.int32)
    return p & 15, p >> 4
