"""MXFP4 in JAX: the bit-exact decode, a jit-able encode, and the resident expert weight.

The format (SPEC.md §6; k3jax.checkpoint.mxfp4 holds the numpy codec and the
compressed-tensors rules): a weight [..., out, in] is `packed` uint8 [..., out, in/2] (two
E2M1 codes per byte, element 2i in the low nibble) and `scale` uint8 [..., out, in/32]
(E8M0, 2**(s - 127) per 32 consecutive inputs).
"""
from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

GROUP_SIZE = 32

# Value of each 4-bit code; index 8 is -0.0 so that code 8 decodes with its sign.
E2M1_VALUES = np.array(
    [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0],
    dtype=np.float32,
)
_E8M0_NAN = 255


class MXFP4(NamedTuple):
    """Routed experts held as the checkpoint stores them: packed [E, out, in/2] and scale
    [E, out, in/32], uint8 (the checkpoint's [out, in] orientation, so bytes load and export
    unchanged). A pytree: shard_map and jit see two uint8 leaves."""
    packed: jax.Array
    scale: jax.Array

    @property
    def in_features(self) -> int:
        return self.scale.shape[-1] * GROUP_SIZE

    @property
    def out_features(self) -> int:
        return self.packed.shape[-2]


def _check_shapes(packed_shape, scale_shape) -> tuple[int, int]:
    if len(packed_shape) < 2:
        raise ValueError(f"weight_packed must be [..., out, in/2], got shape {tuple(packed_shape)}")
    half = packed_shape[-1]
    n_in = 2 * half
    if n_in % GROUP_SIZE:
        raise ValueError(
            f"weight_packed shape {tuple(packed_shape)}: input dim {n_in} is not a multiple "
            f"of the MXFP4 group size {GROUP_SIZE}"
        )
    groups = n_in // GROUP_SIZE
    expected = (*packed_shape[:-1], groups)
    if tuple(scale_shape) != expected:
        raise ValueError(
            f"weight_scale shape {tuple(scale_shape)} does not match weight_packed "
            f"{tuple(packed_shape)} (expected {expected}: one scale per {GROUP_SIZE} inputs)"
        )
    return n_in, groups


def _check_uint8(packed_dtype, scale_dtype) -> None:
    if packed_dtype != np.uint8 or scale_dtype != np.uint8:
        raise TypeError(
            f"weight_packed and weight_scale must be uint8, got {packed_dtype} and {scale_dtype}"
        )


# -- decoding -------------------------------------------------------------------------


def _ldexp_e2m1_f32(v: jax.Array, s: jax.Array) -> jax.Array:
    """``v * 2**(s - 127)`` for E2M1 values ``v`` (fp32) and scale bytes ``s``, exactly.

    Done on the fp32 bit pattern because XLA's CPU (and TPU) arithmetic flushes subnormal
    results to zero, while scale bytes 0 and 1 legitimately produce subnormals. Conversions
    do not flush, so the later cast to bf16 keeps them.
    """
    bits = jax.lax.bitcast_convert_type(v, jnp.uint32)
    sign = bits & jnp.uint32(0x8000_0000)
    exp = ((bits >> 23) & 0xFF).astype(jnp.int32)  # 0 for +/-0, 126..129 otherwise
    mant = bits & jnp.uint32(0x7F_FFFF)
    new_exp = exp + s.astype(jnp.int32) - 127
    normal = (jnp.clip(new_exp, 0, 255).astype(jnp.uint32) << 23) | mant
    # Below the normal range the implicit 1 moves into the mantissa. E2M1 values have at
    # most two significant bits and new_exp >= -1, so this shift (<= 2) drops no set bits.
    shift = jnp.clip(1 - new_exp, 0, 31).astype(jnp.uint32)
    subnormal = (mant | jnp.uint32(0x80_0000)) >> shift
    mag = jnp.where(
        exp == 0,
        jnp.uint32(0),
        jnp.where(
            new_exp >= 255,
            jnp.uint32(0x7F80_0000),
            jnp.where(new_exp >= 1, normal, subnormal),
        ),
    )
    out = jax.lax.bitcast_convert_type(sign | mag, jnp.float32)
    return jnp.where(s == _E8M0_NAN, jnp.float32(jnp.nan), out)


def dequantize_mxfp4(packed, scale, dtype=jnp.bfloat16) -> jax.Array:
    """Decode MXFP4 ``packed`` [..., out, in/2] u8 and ``scale`` [..., out, in/32] u8.

    Returns ``[..., out, in]`` in ``dtype``, bit-exact: codes go through
    ``float4_e2m1fn`` by bitcast, the scale is applied as an exact power of two in fp32,
    then one cast to ``dtype`` (exact for bf16/fp32). Leading dims (stacked experts or
    layers) are carried through. jit-compatible.
    """
    packed = jnp.asarray(packed)
    scale = jnp.asarray(scale)
    _check_uint8(packed.dtype, scale.dtype)
    _check_shapes(packed.shape, scale.shape)
    return _dequantize(packed, scale, jnp.dtype(dtype))


@functools.partial(jax.jit, static_argnums=2)
def _dequantize(packed: jax.Array, scale: jax.Array, dtype) -> jax.Array:
    lead = packed.shape[:-1]
    n_in = 2 * packed.shape[-1]
    groups = n_in // GROUP_SIZE
    # Nibbles are split explicitly (low first) rather than bitcasting u8 -> f4 directly,
    # whose nibble order is a backend layout detail.
    nibbles = jnp.stack([packed & 0xF, packed >> 4], axis=-1).astype(jnp.uint4)
    codes = jax.lax.bitcast_convert_type(nibbles, jnp.float4_e2m1fn)
    vals = codes.astype(jnp.float32).reshape(*lead, groups, GROUP_SIZE)
    out = _ldexp_e2m1_f32(vals, scale[..., None])
    return out.reshape(*lead, n_in).astype(dtype)


def dequantize_experts(w: MXFP4, dtype) -> jax.Array:
    """[E, out, in/2] + scales -> [E, in, out] in `dtype`: the whole stack widened, for the
    small-config `dense` oracle only; the grouped matmuls dequantize tile by tile."""
    return jnp.swapaxes(_dequantize(w.packed, w.scale, jnp.dtype(dtype)), -1, -2)


# -- encoding ---------------------------------------------------------------------------


def _pow2(e):
    """2**e as fp32 for integer e in [-127, 127], exactly (no subnormal factor)."""
    return jax.lax.bitcast_convert_type(((e + 127).astype(jnp.uint32) << 23), jnp.float32)


@jax.jit
def quantize_mxfp4_jax(w):
    """`k3jax.checkpoint.mxfp4.quantize_mxfp4` under jit: (packed u8 [..., out, in/2], scale
    u8 [..., out, in/32]) for w [..., out, in] in fp32 or bf16, the same bytes for every
    normal-range input (random init, merged adapters). Groups holding inf or NaN get scale
    255 (NaN in E8M0) instead of an error, which jit cannot raise."""
    *lead, n_out, n_in = w.shape
    if n_in % GROUP_SIZE:
        raise ValueError(f"weight shape {w.shape}: in must be a multiple of {GROUP_SIZE}")
    dt = jnp.dtype(w.dtype)
    nmant, nexp, uint = {jnp.dtype(jnp.float32): (23, 8, jnp.uint32),
                         jnp.dtype(jnp.bfloat16): (7, 8, jnp.uint16)}[dt]
    g = w.reshape(*lead, n_out, n_in // GROUP_SIZE, GROUP_SIZE)
    amax = jnp.max(jnp.abs(g), axis=-1)
    # compressed-tensors' rounding of the group max to a power of two, on w's own bits
    bits = jax.lax.bitcast_convert_type(amax, uint).astype(jnp.uint32)
    mask = ((1 << (nexp + 1)) - 1) << nmant
    biased = (((bits + jnp.uint32(1 << (nmant - 2))) & jnp.uint32(mask)) >> nmant).astype(jnp.int32)
    s = biased - ((1 << (nexp - 1)) - 1) + 127 - 2
    s = jnp.where(biased == 0, 0, s)
    s = jnp.where(biased == (1 << nexp) - 1, _E8M0_NAN, s)
    s = jnp.clip(s, 0, 255)
    s = jnp.where(jnp.any(~jnp.isfinite(g), axis=-1), _E8M0_NAN, s)
    # q = w · 2**(127 - s) in two exact power-of-two steps (a single 2**-127 is subnormal)
    e = 127 - s
    e1 = e // 2
    q = g.astype(jnp.float32) * _pow2(e1)[..., None] * _pow2(e - e1)[..., None]
    mag = jnp.abs(q)
    idx = sum(c.astype(jnp.uint8) for c in (mag > 0.25, mag >= 0.75, mag > 1.25, mag >= 1.75,
                                           mag > 2.5, mag >= 3.5, mag > 5.0))
    codes = idx | (jnp.signbit(q).astype(jnp.uint8) << 3)
    codes = codes.reshape(*lead, n_out, n_in // 2, 2)
    return (codes[..., 0] | (codes[..., 1] << 4)).astype(jnp.uint8), s.astype(jnp.uint8)
