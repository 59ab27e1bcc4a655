"""fp32 values to MXFP4 (E8M0 scale bytes and E2M1 codes), and the low-rank merge that
quantization-aware fine-tuning re-quantizes: on jnp arrays of any shape, in kernels too.

The rounding is compressed-tensors' (k3jax.checkpoint.mxfp4.quantize_mxfp4, the exporter's)
for fp32 input, bit for bit (tests/ops/test_qat.py): a group's scale is its max |v| rounded
to a power of two on the fp32 bits (up when the mantissa is >= 0.75), less 2 (E2M1's top
exponent); each value divided by it rounds to the nearest E2M1 magnitude, ties to even,
the sign taken from the float's sign bit. Only integer arithmetic, compares, selects,
same-width bitcasts and multiplications by exact powers of two: what lowers inside Mosaic
and Triton kernels as well as in XLA. Groups are given as two halves (the even and odd
inputs of each 32, as the kernels hold them: decode.py), or whole.

`lowrank(left, right)`: Σ_j left[..., :, j] · right[..., j, :] in fp32, one rank at a time
in a fixed order, never a dot (a dot's summation order is the backend's, and re-quantization
rounds differently where the last bit differs), each product added as four exact partial
products (12-bit halves of each factor), so that no backend's FMA contraction changes a
rounding. The exporter (k3jax.checkpoint.update_loss.merged_fp32) does the same operations
in numpy. (Results in fp32's subnormal range, which XLA:CPU flushes, are the one exception;
adapter products never come near 1e-38.)
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

E8M0_NAN = 255
_F32_INF = 0x7F80_0000


def _pow2(e):
    """2**e as fp32 for int32 e in [-126, 127], built from its bits (never subnormal)."""
    return jax.lax.bitcast_convert_type((e + 127) << 23, jnp.float32)


def scale_bytes(amax):
    """E8M0 bytes (int32) for fp32 group maxima amax >= 0 (inf/NaN: 255)."""
    bits = jax.lax.bitcast_convert_type(amax, jnp.int32)
    finite = bits < _F32_INF
    # + 2**21 carries into the exponent exactly when the mantissa is >= 0.75
    biased = (jnp.minimum(bits, _F32_INF) + (1 << 21)) >> 23
    s = jnp.where(biased == 0, 0, biased - 2)
    s = jnp.where(biased >= 255, E8M0_NAN, s)
    return jnp.where(finite, jnp.clip(s, 0, 255), E8M0_NAN)


def codes(v, s):
    """E2M1 codes (int32, bit 3 the sign) of fp32 values v under scale bytes s (int32,
    broadcast to v)."""
    e = 127 - jnp.minimum(s, 254)              # 255 (NaN) groups decode to NaN whatever the code
    e1 = e >> 1      # floor(e / 2), as a shift: Mosaic lowers an integer // only with the TPU at hand
    # two exact steps: 2**(127 - s) may not be normal
    q = v * _pow2(e1) * _pow2(e - e1)
    mag = jnp.abs(q)
    idx = sum(c.astype(jnp.int32) for c in (mag > 0.25, mag >= 0.75, mag > 1.25, mag >= 1.75,
                                           mag > 2.5, mag >= 3.5, mag > 5.0))
    sign = jax.lax.bitcast_convert_type(v, jnp.int32) < 0
    return idx | (sign.astype(jnp.int32) << 3)


def group_max_halves(lo, hi):
    """Per-group max |v| [..., C/16] of the halves lo, hi [..., C] (even and odd inputs;
    16 of each make one group of 32)."""
    *lead, c = lo.shape
    m = jnp.maximum(jnp.abs(lo), jnp.abs(hi)).reshape(*lead, c // 16, 16)
    return jnp.max(m, axis=-1)


def expand(s, n=16):
    """[..., G] -> [..., G·n], each entry repeated n times (a scale over its group's halves)."""
    *lead, g = s.shape
    return jnp.broadcast_to(s[..., None], (*lead, g, n)).reshape(*lead, g * n)


def quantize_halves(lo, hi):
    """(scale bytes [..., C/16], codes of lo, codes of hi [..., C]), all int32."""
    s = scale_bytes(group_max_halves(lo, hi))
    se = expand(s)
    return s, codes(lo, se), codes(hi, se)


def _split(x):
    """fp32 x as hi + lo, each of at most 12 significant bits (hi: x's top 12 by masking;
    lo = x − hi, exact): products of such halves are exact in fp32. A numpy scalar (the
    merge's scale) is split in numpy: Triton lowers no bitcast of a constant."""
    if isinstance(x, np.floating):
        hi = (np.asarray(x, np.float32).view(np.int32) & np.int32(-4096)).view(np.float32)[()]
        return hi, np.float32(x - hi)
    hi = jax.lax.bitcast_convert_type(jax.lax.bitcast_convert_type(x, jnp.int32) & jnp.int32(-4096), jnp.float32)
    return hi, x - hi


def _add_product(acc, x, y):
    """acc + x·y as four exact partial products added in a fixed order. Exact products make
    the sum immune to a compiler fusing a multiply and an add into one FMA (XLA:CPU, GPUs
    do), which would otherwise round differently from the exporter's numpy."""
    xh, xl = _split(x)
    yh, yl = _split(y)
    for p in (xh * yh, xh * yl, xl * yh, xl * yl):
        acc = acc + p
    return acc


def _ranks(cols, rows):
    """Σ_j cols[j] · rows[j] in fp32, rank j after rank j - 1 (each `_add_product`'s exact
    parts): cols[j] [..., P, 1], rows[j] [..., 1, Q]."""
    acc = jnp.zeros(jnp.broadcast_shapes(cols[0].shape, rows[0].shape), jnp.float32)
    for c, r in zip(cols, rows):
        acc = _add_product(acc, c.astype(jnp.float32), r.astype(jnp.float32))
    return acc


def _by_rank(left, right):
    """left [..., P, r], right [..., r, Q] as their rank slices ([..., P, 1] and [..., 1, Q])."""
    r = left.shape[-1]
    return [left[..., :, j:j + 1] for j in range(r)], [right[..., j:j + 1, :] for j in range(r)]


def lowrank(left, right):
    """left [..., P, r], right [..., r, Q] -> [..., P, Q] fp32, one rank at a time in order
    (each rank's product as `_add_product`'s exact parts)."""
    return _ranks(*_by_rank(left, right))


def merge(w, left, right, scale):
    """w + scale · lowrank(left, right) in fp32 (w any float dtype, widened exactly), the
    scale's product in exact parts too."""
    return merge_ranks(w, *_by_rank(left, right), scale)


def merge_ranks(w, cols, rows, scale):
    """`merge` with the adapters given rank by rank (cols[j] = left[..., :, j:j+1], rows[j] =
    right[..., j:j+1, :]), as a kernel that cannot slice a loaded block (Triton) loads them:
    the same operations in the same order, so the same bits."""
    return _add_product(w.astype(jnp.float32), np.float32(scale), _ranks(cols, rows))
