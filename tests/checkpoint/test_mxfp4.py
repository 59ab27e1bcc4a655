"""MXFP4 codec: bit-exact decode, compressed-tensors' rounding, byte-identical round trips."""

import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from k3jax.checkpoint.mxfp4 import (
    GROUP_SIZE,
    dequantize_mxfp4,
    dequantize_mxfp4_np,
    quantize_mxfp4,
    requantize_with_scale,
)
from k3jax.checkpoint.safetensors_io import SafetensorsFile
from helpers import FIXTURES
from reference import mxfp4_decode_ref

FIXTURE_B = FIXTURES / "fixture_b" / "model.safetensors"

BF16 = np.dtype(ml_dtypes.bfloat16)
SCALES = [0, 1, 2, 3, 100, 126, 127, 128, 200, 252, 253, 254, 255]

# Twice each E2M1 magnitude, so the table is integers.


def _to(x64: np.ndarray, dtype) -> np.ndarray:
    with np.errstate(over="ignore"):
        return x64.astype(np.float32).astype(dtype)


def _same_bits(a: np.ndarray, b: np.ndarray) -> bool:
    assert a.dtype == b.dtype and a.shape == b.shape, (a.dtype, b.dtype, a.shape, b.shape)
    u = {2: np.uint16, 4: np.uint32, 8: np.uint64}[a.dtype.itemsize]
    nan = np.isnan(a.astype(np.float64))
    if not np.array_equal(nan, np.isnan(b.astype(np.float64))):
        return False
    return bool(np.array_equal(a.view(u)[~nan], b.view(u)[~nan]))


@pytest.fixture(scope="module")
def all_bytes():
    """Every byte value under every test scale: packed [S, 16, 16], scale [S, 16, 1]."""
    packed = np.broadcast_to(np.arange(256, dtype=np.uint8).reshape(16, 16), (len(SCALES), 16, 16))
    scale = np.broadcast_to(np.array(SCALES, dtype=np.uint8)[:, None, None], (len(SCALES), 16, 1))
    return np.ascontiguousarray(packed), np.ascontiguousarray(scale)


# -- decode -----------------------------------------------------------------------------


def test_decode_every_byte_every_scale_bit_exact(all_bytes):
    packed, scale = all_bytes
    ref = mxfp4_decode_ref(packed, scale)
    for dtype in (np.float32, BF16):
        want = _to(ref, dtype)
        got_jax = np.asarray(dequantize_mxfp4(packed, scale, dtype=jnp.dtype(dtype)))
        got_np = dequantize_mxfp4_np(packed, scale, dtype=dtype)
        assert _same_bits(got_jax, want), dtype
        assert _same_bits(got_np, want), dtype
    # Spot checks of the conventions themselves: low nibble first, code 8 is -0.
    i = SCALES.index(127)
    row = np.asarray(dequantize_mxfp4(packed[i], scale[i], dtype=jnp.float32))
    assert row[0, 2 * 0x01] == 0.5 and row[0, 2 * 0x01 + 1] == 0.0  # byte 0x01
    assert row[1, 0] == 0.0 and row[1, 1] == 0.5  # byte 0x10
    assert np.signbit(row[0, 2 * 0x08]) and row[0, 2 * 0x08] == 0.0
    assert row[15, 31] == -6.0  # byte 0xFF, high nibble


def test_decode_subnormal_and_overflow_extremes():
    # Scale bytes 0/1 make subnormals (XLA CPU arithmetic would flush them); 254 overflows.
    packed = np.array([[0x21] * 16], dtype=np.uint8)  # codes 1 (0.5), 2 (1.0)
    for s, lo, hi in [
        (0, 2.0**-128, 2.0**-127),
        (1, 2.0**-127, 2.0**-126),
        (254, 2.0**126, 2.0**127),
    ]:
        got = np.asarray(dequantize_mxfp4(packed, np.array([[s]], np.uint8), dtype=jnp.float32))
        assert got[0, 0] == np.float32(lo) and got[0, 1] == np.float32(hi), s
    sixes = np.array([[0x77] * 16], np.uint8)
    got = np.asarray(dequantize_mxfp4(sixes, np.array([[254]], np.uint8), jnp.float32))
    assert np.isposinf(got).all()


def test_decode_leading_dims_and_jit():
    import jax

    rng = np.random.default_rng(0)
    packed = rng.integers(0, 256, size=(2, 3, 4, 32), dtype=np.uint8)
    scale = rng.integers(100, 150, size=(2, 3, 4, 2), dtype=np.uint8)
    got = np.asarray(jax.jit(dequantize_mxfp4)(packed, scale))
    assert got.shape == (2, 3, 4, 64) and got.dtype == BF16
    for i in range(2):
        for j in range(3):
            assert _same_bits(got[i, j], dequantize_mxfp4_np(packed[i, j], scale[i, j], BF16))


def test_decode_rejects_bad_shapes():
    with pytest.raises(ValueError, match="weight_scale shape"):
        dequantize_mxfp4(np.zeros((4, 16), np.uint8), np.zeros((4, 2), np.uint8))
    with pytest.raises(ValueError, match="multiple"):
        dequantize_mxfp4_np(np.zeros((4, 8), np.uint8), np.zeros((4, 1), np.uint8))
    with pytest.raises(TypeError, match="uint8"):
        dequantize_mxfp4_np(np.zeros((4, 16), np.int8), np.zeros((4, 1), np.uint8))


# -- round trips ------------------------------------------------------------------------


def _dequant_variants(packed, scale):
    yield dequantize_mxfp4_np(packed, scale, np.float32)
    yield dequantize_mxfp4_np(packed, scale, np.float64)
    yield np.asarray(dequantize_mxfp4(packed, scale, dtype=jnp.bfloat16))
    yield np.asarray(dequantize_mxfp4(packed, scale, dtype=jnp.float32))


def test_requantize_with_scale_is_byte_identical_on_any_valid_tensor():
    rng = np.random.default_rng(1)
    packed = rng.integers(0, 256, size=(3, 16, 64), dtype=np.uint8)
    scale = rng.integers(0, 253, size=(3, 16, 4), dtype=np.uint8)
    scale[0, 0] = [0, 1, 2, 252]  # extremes: subnormal results and the largest finite scale
    packed[1, 2, :16] = 0x88  # a group of -0 codes
    packed[1, 3, :16] = 0x00  # a group of +0 codes, whose scale byte is not 0
    scale[1, 3, 0] = 77
    for w in _dequant_variants(packed, scale):
        assert np.array_equal(requantize_with_scale(w, scale), packed), w.dtype


def test_requantize_with_scale_every_byte(all_bytes):
    packed, scale = all_bytes
    finite = np.array([s <= 252 for s in SCALES])
    packed, scale = packed[finite], scale[finite]
    for w in _dequant_variants(packed, scale):
        assert np.array_equal(requantize_with_scale(w, scale), packed), w.dtype


def _ct_form(rng, shape):
    """Random packed/scale of the form compressed-tensors writes: each group's largest
    magnitude code is 6 or 7 (value 4 or 6), or the group is all zero with scale 0."""
    *lead, n_out, n_in = shape
    codes = rng.integers(0, 16, size=(*lead, n_out, n_in // GROUP_SIZE, GROUP_SIZE), dtype=np.uint8)
    top = rng.integers(6, 8, size=codes.shape[:-1], dtype=np.uint8)
    sign = rng.integers(0, 2, size=codes.shape[:-1], dtype=np.uint8) << 3
    codes[..., 0] = top | sign
    scale = rng.integers(0, 253, size=codes.shape[:-1], dtype=np.uint8)
    zero = rng.random(codes.shape[:-1]) < 0.1
    codes[zero] = rng.choice(np.array([0, 8], np.uint8), size=(int(zero.sum()), GROUP_SIZE))
    scale[zero] = 0
    codes = codes.reshape(*lead, n_out, n_in // 2, 2)
    return (codes[..., 0] | (codes[..., 1] << 4)).astype(np.uint8), scale


def test_quantize_dequantize_round_trip_on_compressed_tensors_form():
    rng = np.random.default_rng(2)
    packed, scale = _ct_form(rng, (4, 32, 128))
    for w in _dequant_variants(packed, scale):
        p, s = quantize_mxfp4(w)
        assert np.array_equal(s, scale), w.dtype
        assert np.array_equal(p, packed), w.dtype


def test_quantize_is_idempotent_through_dequantize():
    rng = np.random.default_rng(3)
    w = rng.standard_normal((6, 16, 96)).astype(np.float32)
    w *= np.exp2(rng.integers(-130, 120, size=(6, 16, 1))).astype(np.float32)
    w[0, 0] = 0.0
    for dtype in (np.float32, BF16):
        p, s = quantize_mxfp4(w.astype(dtype))
        for back in _dequant_variants(p, s):
            p2, s2 = quantize_mxfp4(back)
            assert np.array_equal(p2, p) and np.array_equal(s2, s), (dtype, back.dtype)


def test_zero_group_scale_needs_requantize_with_scale():
    packed = np.full((1, 16), 0x88, np.uint8)  # 32 x -0.0
    scale = np.array([[120]], np.uint8)
    w = dequantize_mxfp4_np(packed, scale)
    assert np.all(w == 0) and np.all(np.signbit(w))
    p, s = quantize_mxfp4(w)
    assert np.array_equal(p, packed)  # -0.0 comes back as code 8
    assert s[0, 0] == 0  # the scale byte is not recoverable from zeros...
    assert np.array_equal(requantize_with_scale(w, scale), packed)  # ...so pass it in


def test_quantize_rounding_rules():
    # One group at scale 1 (max 6 -> scale byte 127): ties go to the even E2M1 neighbour.
    x = [6.0, 0.25, 0.2500001, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 5.0000005, -0.1, -0.0, 0.0, -6.0]
    w = np.zeros((1, 32), np.float32)
    w[0, : len(x)] = x
    p, s = quantize_mxfp4(w)
    assert s[0, 0] == 127
    codes = np.stack([p & 0xF, p >> 4], -1).reshape(-1)[: len(x)]
    assert codes.tolist() == [7, 0, 1, 2, 2, 4, 4, 6, 6, 7, 8, 8, 0, 15]
    # With a given scale, values past 6 clamp to the largest code.
    w[0, :2] = [7.0, -1e30]
    p = requantize_with_scale(w, s)
    assert p[0, 0] == 0xF7


def test_quantize_scale_rule():
    # Group max rounds to a power of two, up only when its mantissa is >= 0.75.
    for amax, want in [
        (1.0, 125),
        (1.74, 125),
        (np.nextafter(np.float32(1.75), np.float32(0)), 125),
        (1.75, 126),
        (6.0, 127),
        (7.0, 128),
        (2.0**-140, 0),
        (2.0**126, 251),
        (0.0, 0),
    ]:
        w = np.zeros((1, 32), np.float32)
        w[0, 5] = -amax
        assert quantize_mxfp4(w)[1][0, 0] == want, amax


def test_quantize_rejects_bad_input():
    with pytest.raises(ValueError, match="inf or NaN"):
        quantize_mxfp4(np.full((1, 32), np.nan, np.float32))
    with pytest.raises(ValueError, match="too large"):
        quantize_mxfp4(np.full((1, 32), 1e300, np.float64))
    with pytest.raises(ValueError, match="multiple of 32"):
        quantize_mxfp4(np.zeros((2, 48), np.float32))
    with pytest.raises(TypeError):
        quantize_mxfp4(np.zeros((2, 32), np.int32))
    with pytest.raises(ValueError, match="scale shape"):
        requantize_with_scale(np.zeros((2, 64), np.float32), np.zeros((2, 1), np.uint8))
    with pytest.raises(ValueError, match="255"):
        requantize_with_scale(np.zeros((1, 32), np.float32), np.array([[255]], np.uint8))


def test_quantize_leading_dims_match_per_matrix():
    rng = np.random.default_rng(4)
    w = rng.standard_normal((3, 8, 64)).astype(np.float32)
    p, s = quantize_mxfp4(w)
    for e in range(3):
        pe, se = quantize_mxfp4(w[e])
        assert np.array_equal(p[e], pe) and np.array_equal(s[e], se)


# -- compressed-tensors itself ----------------------------------------------------------


@pytest.fixture(scope="module")
def ct():
    """compressed-tensors' own MXFP4 pipeline (needs torch), or a skip saying why not."""
    try:
        import torch
        from compressed_tensors.compressors.mxfp4.base import MXFP4PackedCompressor
        from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme
        from compressed_tensors.quantization.utils.helpers import compute_dynamic_scales_and_zp
    except Exception as e:  # ImportError, or a torch that fails to load
        pytest.skip(f"compressed-tensors cannot be imported here: {e!r}")

    args = QuantizationArgs(
        num_bits=4, type="float", strategy="group", group_size=32, symmetric=True,
        scale_dtype=torch.uint8, dynamic=False,
    )
    scheme = QuantizationScheme(targets=["Linear"], weights=args)

    def to_torch(a: np.ndarray):
        if a.dtype == BF16:
            return torch.from_numpy(a.view(np.int16).copy()).view(torch.bfloat16)
        return torch.from_numpy(np.ascontiguousarray(a))

    def quantize(w: np.ndarray):
        t = to_torch(w)
        s, zp = compute_dynamic_scales_and_zp(t, args, module=None)
        out = MXFP4PackedCompressor.compress(
            {"weight": t, "weight_scale": s, "weight_zero_point": zp}, scheme
        )
        return out["weight_packed"].numpy(), out["weight_scale"].numpy()

    def decompress(packed: np.ndarray, scale: np.ndarray) -> np.ndarray:
        out = MXFP4PackedCompressor.decompress(
            {"weight_packed": to_torch(packed), "weight_scale": to_torch(scale)}, scheme
        )
        w = out["weight"]
        assert w.dtype == torch.bfloat16
        return w.view(torch.int16).numpy().view(BF16)

    return quantize, decompress


def _hard_weights(rng) -> np.ndarray:
    """Groups that stress every rounding decision, with no exact -0.0 (the one documented
    difference)."""
    rows = []
    for lg in (-140, -128, -126, -60, -8, 0, 8, 60, 120, 125):
        r = rng.standard_normal(64) * 2.0**lg
        rows.append(r)
    ties = np.array([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0])
    for k in (-126, -3, 0, 5):
        g = np.concatenate([[6.0], ties, -ties, np.nextafter(ties, 0), np.nextafter(ties, 9)])
        rows.append(np.resize(g, 64) * 2.0**k)
    for m in (1.75, np.nextafter(1.75, 0), 1.0, 3.999, 0.0):
        r = rng.uniform(-1, 1, 64) * m * 0.5
        r[[3, 40]] = m
        rows.append(r)
    w = np.stack(rows).astype(np.float32)
    return np.where(w == 0, np.float32(0.0), w)


@pytest.mark.parametrize("dtype", [np.float32, BF16], ids=["f32", "bf16"])
def test_quantize_matches_compressed_tensors(ct, dtype):
    quantize_ct, _ = ct
    rng = np.random.default_rng(5)
    w = _hard_weights(rng).astype(dtype)
    w = np.where(w.astype(np.float32) == 0, np.zeros((), dtype), w)  # bf16 may underflow to -0
    p_ct, s_ct = quantize_ct(w)
    p, s = quantize_mxfp4(w)
    assert np.array_equal(s, s_ct)
    assert np.array_equal(p, p_ct)


def test_negative_zero_input_is_the_one_difference_from_compressed_tensors(ct):
    quantize_ct, _ = ct
    w = np.zeros((1, 32), np.float32)
    w[0, 0], w[0, 1], w[0, 2] = 4.0, -0.0, -0.01
    p_ct, _ = quantize_ct(w)
    p, _ = quantize_mxfp4(w)
    assert p_ct[0, 0] == 0x06 and p[0, 0] == 0x86  # -0.0 -> code 0 there, code 8 here
    assert p_ct[0, 1] == p[0, 1] == 0x08  # a small negative is code 8 in both
    assert np.array_equal(p_ct[0, 2:], p[0, 2:])


def test_decode_matches_compressed_tensors(ct, all_bytes):
    _, decompress_ct = ct
    packed, scale = all_bytes
    # compressed-tensors gives inf * code for scale byte 255 where OCP E8M0 says NaN.
    for p, s in zip(packed, scale):
        if s[0, 0] == 255:
            continue
        want = decompress_ct(p, s)
        assert _same_bits(np.asarray(dequantize_mxfp4(p, s, dtype=jnp.bfloat16)), want), s[0, 0]


# -- the real checkpoint layout ---------------------------------------------------------


def _fixture_experts():
    if not FIXTURE_B.exists():
        pytest.skip(f"fixture not found: {FIXTURE_B}")
    with SafetensorsFile(FIXTURE_B) as f:
        names = [k for k in f.keys() if k.endswith(".weight_packed")]
        assert names
        return [
            (k, np.array(f.get(k)), np.array(f.get(k.replace("weight_packed", "weight_scale"))))
            for k in names
        ]


def test_fixture_experts_round_trip_byte_identical():
    experts = _fixture_experts()
    assert len(experts) == 216
    for name, packed, scale in experts:
        assert "experts." in name and packed.dtype == np.uint8 and scale.dtype == np.uint8
        w_np = dequantize_mxfp4_np(packed, scale, np.float32)
        w_bf16 = np.asarray(dequantize_mxfp4(packed, scale, dtype=jnp.bfloat16))
        assert _same_bits(w_bf16.astype(np.float32), w_np), name
        for w in (w_np, w_bf16):
            assert np.array_equal(requantize_with_scale(w, scale), packed), name
            p, s = quantize_mxfp4(w)
            assert np.array_equal(p, packed) and np.array_equal(s, scale), name


def test_fixture_experts_decode_matches_independent_and_compressed_tensors(ct):
    _, decompress_ct = ct
    for name, packed, scale in _fixture_experts()[:12]:
        ours = np.asarray(dequantize_mxfp4(packed, scale, dtype=jnp.bfloat16))
        assert _same_bits(ours, _to(mxfp4_decode_ref(packed, scale), BF16)), name
        assert _same_bits(ours, decompress_ct(packed, scale)), name
