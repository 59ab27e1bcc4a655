"""MXFP4 weights as stored by compressed-tensors' ``mxfp4-pack-quantized`` format.

Layout (SPEC.md §6), for a weight ``w`` of shape ``[..., out, in]``:

* ``weight_packed`` uint8 ``[..., out, in/2]``: two E2M1 codes per byte, element ``2i`` in
  the LOW nibble of byte ``i``, element ``2i+1`` in the high nibble. A code is a sign bit
  (bit 3) over a magnitude index 0..7 -> 0, 0.5, 1, 1.5, 2, 3, 4, 6.
* ``weight_scale`` uint8 ``[..., out, in/32]``: one E8M0 exponent per group of 32 inputs,
  value ``2**(s - 127)``; ``s = 255`` is NaN (OCP MX).

Decoding is exact: every decoded value is a code times a power of two, representable in
bf16/fp32 (subnormals included) unless it overflows, which only scale bytes >= 253 can do.

Encoding follows compressed-tensors 0.20 (``calculate_qparams`` -> ``generate_mx_scales``
for the scale, ``quantize`` -> ``cast_to_fp4`` -> ``pack_fp4_to_uint8`` for the codes):

* scale: ``amax`` = max |w| over the group, in w's own float format. Its bit pattern gets
  ``1 << (mantissa_bits - 2)`` added and the mantissa masked off, i.e. ``amax`` is rounded
  down to a power of two ``2**e`` unless its mantissa is >= 0.75, then up to ``2**(e+1)``;
  ``s = clip(127 + e - 2, 0, 255)`` (``-2`` = floor(log2 6), E2M1's largest exponent). So
  ``amax / 2**(s-127)`` lies in [3.5, 7) and the group's largest code is always 4 or 6. An
  all-zero group gets ``s = 0``.
* codes: ``w / 2**(s-127)`` clamped to [-6, 6] and rounded to the nearest E2M1 value, ties
  to even (0.25 -> 0, 0.75 -> 1, 1.25 -> 1, 1.75 -> 2, 2.5 -> 2, 3.5 -> 4, 5 -> 4).
* sign: compressed-tensors sets bit 3 when the scaled value is < 0, so a small negative
  weight becomes code 8 (-0). Here bit 3 is the float's sign bit instead. The two differ
  only for an input that is exactly -0.0 (compressed-tensors writes code 0), and that
  choice is what lets a dequantized code 8 (-0.0) quantize back to code 8.

Round trips:

* :func:`requantize_with_scale` (given the original scale bytes) returns the original
  packed bytes for ANY valid MXFP4 tensor whose dequantized values are finite
  (every tensor with scale bytes <= 252). The exporter uses it to write unchanged experts
  back byte for byte.
* :func:`quantize_mxfp4` derives the scale from the values, so it reproduces a tensor only
  if that tensor's scales are the ones compressed-tensors would have chosen: every group's
  largest code is 4 or 6, or the group is all zero with scale byte 0. Everything
  compressed-tensors writes is of that form (``quantize_mxfp4`` is idempotent through
  dequantize). A group of all (+/-)0 codes keeps no trace of its scale byte in the values,
  which is why the exporter must pass the original scales.
"""
from __future__ import annotations

import ml_dtypes
import numpy as np

# the JAX decode lives with the ops that dequantize inside their matmuls
from k3jax.ops.mxfp4 import (E2M1_VALUES, GROUP_SIZE, _check_shapes, _check_uint8,  # noqa: F401
                             dequantize_mxfp4)

__all__ = [
    "GROUP_SIZE",
    "E2M1_VALUES",
    "dequantize_mxfp4",
    "dequantize_mxfp4_np",
    "quantize_mxfp4",
    "requantize_with_scale",
]

_E8M0_NAN = 255
_SCALE_OFFSET = 2  # floor(log2(6)): maps the group max into E2M1's top binade


# -- decoding (numpy, for host-side streaming) ------------------------------------------


def dequantize_mxfp4_np(packed, scale, dtype=np.float32) -> np.ndarray:
    """numpy twin of :func:`dequantize_mxfp4`: same values, same bits, no device needed."""
    packed = np.asarray(packed)
    scale = np.asarray(scale)
    _check_uint8(packed.dtype, scale.dtype)
    n_in, groups = _check_shapes(packed.shape, scale.shape)
    lead = packed.shape[:-1]
    codes = np.stack([packed & 0xF, packed >> 4], axis=-1)
    vals = E2M1_VALUES[codes].reshape(*lead, groups, GROUP_SIZE)
    exps = scale.astype(np.int32)[..., None] - 127
    # ldexp is exact, subnormals included; overflow to inf is the correct fp32 answer.
    with np.errstate(over="ignore"):
        out = np.ldexp(vals, exps)
    out = np.where(scale[..., None] == _E8M0_NAN, np.float32(np.nan), out)
    return out.reshape(*lead, n_in).astype(dtype)


# -- encoding (numpy) -------------------------------------------------------------------


def _float_layout(dtype: np.dtype) -> tuple[type, int, int]:
    fi = ml_dtypes.finfo(dtype)
    uint = {2: np.uint16, 4: np.uint32, 8: np.uint64}[dtype.itemsize]
    return uint, int(fi.nmant), int(fi.nexp)


def _as_float(w) -> np.ndarray:
    w = np.asarray(w)
    if w.dtype not in (np.float32, np.float64, np.float16, np.dtype(ml_dtypes.bfloat16)):
        raise TypeError(
            f"MXFP4 quantization needs a float32/bfloat16/float16/float64 array, got {w.dtype}"
        )
    if w.ndim < 2 or w.shape[-1] % GROUP_SIZE:
        raise ValueError(
            f"weight shape {w.shape}: need [..., out, in] with in a multiple of {GROUP_SIZE}"
        )
    return w


def _mx_scale_bytes(amax: np.ndarray) -> np.ndarray:
    """compressed-tensors' shared exponent for group maxima ``amax`` (in w's own dtype)."""
    uint, nmant, nexp = _float_layout(amax.dtype)
    bits = amax.view(uint).astype(np.uint64)
    sign_exp_mask = ((1 << (nexp + 1)) - 1) << nmant
    # Adding half of the top mantissa bit's weight carries into the exponent exactly when
    # the mantissa is >= 0.75: the threshold compressed-tensors uses (E2M1 has 1 mantissa bit).
    p2 = (bits + np.uint64(1 << (nmant - 2))) & np.uint64(sign_exp_mask)
    biased = (p2 >> np.uint64(nmant)).astype(np.int64)
    bias = (1 << (nexp - 1)) - 1
    s = biased - bias + 127 - _SCALE_OFFSET
    # Exponent field 0 means p2 == 0 (log2 -> -inf); all ones means it rounded up to inf.
    s = np.where(biased == 0, 0, s)
    s = np.where(biased == (1 << nexp) - 1, _E8M0_NAN, s)
    return np.clip(s, 0, 255).astype(np.uint8)


def _grouped_f64(w: np.ndarray) -> np.ndarray:
    """``w`` [..., out, in] as fp64 [..., out, in/32, 32], refusing values MXFP4 cannot hold."""
    *lead, n_out, n_in = w.shape
    x = w.astype(np.float64).reshape(*lead, n_out, n_in // GROUP_SIZE, GROUP_SIZE)
    if not np.isfinite(x).all():
        raise ValueError("MXFP4 quantization: weight contains inf or NaN")
    return x


def _encode(x: np.ndarray, scale: np.ndarray) -> np.ndarray:
    """Pack the E2M1 codes of grouped ``x`` [..., out, in/32, 32] under ``scale`` bytes."""
    # fp64 holds every fp32/bf16/fp16 value times 2**(127 - s) exactly, so the rounding below
    # sees the true quotient. compressed-tensors divides in w's dtype; the two can differ
    # only by under/overflow there, which lands on the same code either way.
    q = np.ldexp(x, 127 - scale.astype(np.int32)[..., None])
    mag = np.abs(q)
    idx = (
        (mag > 0.25).astype(np.uint8)
        + (mag >= 0.75)
        + (mag > 1.25)
        + (mag >= 1.75)
        + (mag > 2.5)
        + (mag >= 3.5)
        + (mag > 5.0)
    )
    codes = idx | (np.signbit(q).astype(np.uint8) << 3)
    *lead, n_out, groups, _ = x.shape
    codes = codes.reshape(*lead, n_out, groups * GROUP_SIZE // 2, 2)
    return (codes[..., 0] | (codes[..., 1] << 4)).astype(np.uint8)


def quantize_mxfp4(w) -> tuple[np.ndarray, np.ndarray]:
    """Quantize ``w`` [..., out, in] (fp32/bf16; fp16/fp64 accepted) to MXFP4.

    Returns ``(packed u8 [..., out, in/2], scale u8 [..., out, in/32])``, the bytes
    compressed-tensors writes for fp32/bf16 input (fp16 can differ where compressed-tensors'
    fp16 scale underflows; see the module doc for the one -0.0 difference and for
    when this reproduces an existing tensor; to re-encode a tensor whose scales you have,
    use :func:`requantize_with_scale`).
    """
    w = _as_float(w)
    x = _grouped_f64(w)
    # The max of exact fp64 copies is itself a value of w's dtype, so the cast back is exact
    # and the rounding works on w's own bit layout, as compressed-tensors' does.
    amax = np.abs(x).max(axis=-1)
    scale = _mx_scale_bytes(amax.astype(w.dtype))
    if (scale == _E8M0_NAN).any():
        raise ValueError(
            "MXFP4 quantization: a group maximum is too large for an E8M0 scale "
            f"(largest |w| = {float(amax.max())})"
        )
    return _encode(x, scale), scale


def requantize_with_scale(w, scale) -> np.ndarray:
    """Quantize ``w`` [..., out, in] with the given E8M0 ``scale`` bytes [..., out, in/32].

    Returns packed u8 [..., out, in/2]. With the scales a tensor was stored with, this
    gives back the stored bytes exactly (all-zero groups and -0 codes included), which
    deriving the scale from the values cannot (see module doc).
    """
    w = _as_float(w)
    scale = np.asarray(scale)
    if scale.dtype != np.uint8:
        raise TypeError(f"weight_scale must be uint8, got {scale.dtype}")
    expected = (*w.shape[:-1], w.shape[-1] // GROUP_SIZE)
    if scale.shape != expected:
        raise ValueError(
            f"scale shape {scale.shape} does not match weight {w.shape} (expected {expected})"
        )
    if (scale == _E8M0_NAN).any():
        raise ValueError("MXFP4 requantization: scale byte 255 is NaN in E8M0")
    return _encode(_grouped_f64(w), scale)
