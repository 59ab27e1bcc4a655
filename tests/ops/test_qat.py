"""Quantization-aware fine-tuning's ops (k3jax.ops.qat, pallas_kernels.mxfp4_gmm.encode):
the forward's rounding is the exporter's, bit for bit; the fused kernel (interpret mode)
is the pure path; gradients are straight through (the plain low-rank path's)."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from k3jax.checkpoint.mxfp4 import dequantize_mxfp4_np, quantize_mxfp4
from k3jax.checkpoint.update_loss import merged_fp32
from k3jax.ops.experts import expert_matmul
from k3jax.ops.mxfp4 import MXFP4
from k3jax.ops.mxfp4_matmul import mxfp4_grouped_matmul
from k3jax.ops.qat import expert_matmul_qat, merged_bf16, quantize_oi, requantized, round_bf16
from pallas_kernels.mxfp4_gmm.encode import quantize_halves


def _hard_values(rng, shape):
    """fp32 values that probe every rounding rule: E2M1 ties and thresholds under random
    scales, signed zeros, subnormals, group maxima at and around the 0.75 mantissa cut."""
    n = int(np.prod(shape))
    ties = np.array([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0, 7.0, 0.0, -0.0], np.float32)
    v = rng.choice(ties, n) * np.exp2(rng.integers(-20, 20, n)).astype(np.float32)
    v = np.where(rng.random(n) < 0.5, rng.normal(size=n).astype(np.float32) * np.exp2(rng.integers(-30, 30, n)), v)
    v = np.where(rng.random(n) < 0.02, np.float32(1e-40) * rng.normal(size=n).astype(np.float32), v)
    v[: n // 50] = np.float32(0.0)
    v[n // 50: n // 25] = np.float32(-0.0)
    v = v.astype(np.float32).reshape(shape)
    # group maxima on and just under the 0.75-mantissa cut where the scale rounds up
    cut = (np.float32(1.75) * np.exp2(rng.integers(-10, 10, shape[0]))).astype(np.float32)
    v[:, 0] = np.where(np.arange(shape[0]) % 2, cut, np.nextafter(cut, np.float32(0)))
    return v


def test_quantize_is_the_exporters_rounding_bit_for_bit():
    rng = np.random.default_rng(0)
    w = _hard_values(rng, (96, 256))
    packed, scale = quantize_mxfp4(w)
    got_p, got_s = jax.jit(quantize_oi)(jnp.asarray(w))
    np.testing.assert_array_equal(np.asarray(got_s), scale)
    np.testing.assert_array_equal(np.asarray(got_p), packed)
    # the kernels' form: each group of 32 as its 16 even and 16 odd inputs
    s, lo, hi = jax.jit(quantize_halves)(jnp.asarray(w[:, 0::2]), jnp.asarray(w[:, 1::2]))
    np.testing.assert_array_equal(np.asarray(s), scale)
    np.testing.assert_array_equal(np.asarray(lo | (hi << 4)).astype(np.uint8), packed)


def _case(E=3, N=64, K=64, r=4, shared=False, seed=0):
    rng = np.random.default_rng(seed)
    packed, scale = quantize_mxfp4(rng.normal(size=(E, N, K)).astype(np.float32) * 0.05)
    a = rng.normal(size=(K, r) if shared else (E, K, r)).astype(np.float32) * 0.3
    b = rng.normal(size=(E, r, N)).astype(np.float32) * 0.02
    return packed, scale, a, b, 1.5


def _exporter_weights(packed, scale, a, b, s):
    """What `export --merge-lora` stores for each expert: [E, N, K] decoded."""
    out = []
    for e in range(packed.shape[0]):
        w = dequantize_mxfp4_np(packed[e], scale[e], np.float32)
        ae = a if a.ndim == 2 else a[e]
        merged, _ = merged_fp32(w, b[e].T, ae.T, s)
        out.append(dequantize_mxfp4_np(*quantize_mxfp4(merged), np.float32))
    return np.stack(out)


@pytest.mark.parametrize("impl", ["pure", "pallas"])
@pytest.mark.parametrize("shared", [False, True])
def test_requantizing_product_uses_the_exported_weights_bit_for_bit(impl, shared):
    """Identity rows read each expert's weight out of the product exactly: the pure path's
    blocks and the Mosaic layout's tiles (interpret mode) hold the exporter's values."""
    packed, scale, a, b, s = _case(shared=shared)
    E, N, K = packed.shape[0], packed.shape[1], 2 * packed.shape[2]
    want = _exporter_weights(packed, scale, a, b, s)
    eye = jnp.tile(jnp.eye(K, dtype=jnp.float32), (E, 1))
    sizes = jnp.full((E,), K, jnp.int32)
    got = mxfp4_grouped_matmul(eye, packed, scale, sizes, impl=impl, merge=(a, b, s))      # rows @ Wᵀ
    np.testing.assert_array_equal(np.asarray(got).reshape(E, K, N), np.swapaxes(want, 1, 2))
    eye_n = jnp.tile(jnp.eye(N, dtype=jnp.float32), (E, 1))
    got = mxfp4_grouped_matmul(eye_n, packed, scale, jnp.full((E,), N, jnp.int32), impl=impl,
                               transpose_rhs=False, merge=(a, b, s))                       # rows @ W
    np.testing.assert_array_equal(np.asarray(got).reshape(E, N, K), want)
    # and the one-expert-at-a-time stack (widened bases, decode) is the same bytes
    q = requantized(MXFP4(jnp.asarray(packed), jnp.asarray(scale)), (jnp.asarray(a), jnp.asarray(b)), s)
    np.testing.assert_array_equal(dequantize_mxfp4_np(np.asarray(q.packed), np.asarray(q.scale)), want)


@pytest.mark.parametrize("shared", [False, True])
def test_triton_layout_requantizes_to_the_exported_weights_bit_for_bit(shared):
    """The GPU kernels (Triton layout, interpret mode) re-quantize each chunk they decode:
    identity rows read the exporter's weights out of both orientations' products, bit for
    bit; N = 80 and K / 2 = 48 leave the last chunks part past the arrays (masked loads)."""
    from pallas_kernels.mxfp4_gmm import mxfp4_gmm
    from k3jax.ops.mxfp4_matmul import merge_operands
    packed, scale, a, b, s = _case(E=3, N=80, K=96, r=3, shared=shared, seed=4)
    E, N, K = packed.shape[0], packed.shape[1], 2 * packed.shape[2]
    want = _exporter_weights(packed, scale, a, b, s)
    merge = (*merge_operands(jnp.asarray(a), jnp.asarray(b), packed.shape), s)
    run = lambda x, n, t: mxfp4_gmm(x, jnp.asarray(packed), jnp.asarray(scale), jnp.full((E,), n, jnp.int32),  # noqa: E731
                                    transpose_rhs=t, mode="interpret", layout="triton", merge=merge)
    got = run(jnp.tile(jnp.eye(K, dtype=jnp.float32), (E, 1)), K, True)                  # rows @ Wᵀ
    np.testing.assert_array_equal(np.asarray(got).reshape(E, K, N), np.swapaxes(want, 1, 2))
    got = run(jnp.tile(jnp.eye(N, dtype=jnp.float32), (E, 1)), N, False)                 # rows @ W
    np.testing.assert_array_equal(np.asarray(got).reshape(E, N, K), want)


@pytest.mark.parametrize("transpose_rhs", [True, False])
def test_pallas_interpret_equals_the_pure_path(transpose_rhs):
    packed, scale, a, b, s = _case(E=4, N=128, K=96, r=3, seed=1)
    N, K = packed.shape[1], 2 * packed.shape[2]
    sizes = jnp.array([5, 0, 17, 9], jnp.int32)
    x = jax.random.normal(jax.random.PRNGKey(0), (40, K if transpose_rhs else N), jnp.float32)
    kw = dict(transpose_rhs=transpose_rhs, merge=(a, b, s))
    pure = np.asarray(mxfp4_grouped_matmul(x, packed, scale, sizes, impl="pure", **kw))
    fused = np.asarray(mxfp4_grouped_matmul(x, packed, scale, sizes, impl="pallas", **kw))
    np.testing.assert_allclose(fused, pure, rtol=1e-6, atol=1e-6)
    assert np.all(pure[31:] == 0) and np.all(fused[31:] == 0)     # rows past Σ sizes


def test_straight_through_gradients_are_the_low_rank_paths():
    """A and B get exactly the plain LoRA path's gradients; rows get the quantized product's."""
    packed, scale, a, b, s = _case(E=3, N=64, K=64, r=2, seed=2)
    w = MXFP4(jnp.asarray(packed), jnp.asarray(scale))
    sizes = jnp.array([6, 3, 7], jnp.int32)
    x = jax.random.normal(jax.random.PRNGKey(1), (16, 64), jnp.float32)
    ct = jax.random.normal(jax.random.PRNGKey(2), (16, 64), jnp.float32)
    ad = (jnp.asarray(a), jnp.asarray(b))

    def loss(f):
        return lambda x, ad: jnp.sum(f(x, w, sizes, ad, s) * ct)

    gx, (ga, gb) = jax.grad(loss(expert_matmul_qat), argnums=(0, 1))(x, ad)
    _, (pa, pb) = jax.grad(loss(expert_matmul), argnums=(0, 1))(x, ad)
    np.testing.assert_allclose(np.asarray(ga), np.asarray(pa), rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(np.asarray(gb), np.asarray(pb), rtol=1e-6, atol=1e-7)
    want = _exporter_weights(packed, scale, a, b, s)      # dx = ct @ Q, Q the exported weights
    ids = np.repeat(np.arange(3), np.asarray(sizes))
    ref = np.einsum("mn,mnk->mk", np.asarray(ct, np.float64), want[ids].astype(np.float64))
    np.testing.assert_allclose(np.asarray(gx), ref, rtol=1e-5, atol=1e-6)


def test_widened_experts_full_fine_tuning_gradient_is_straight_through():
    """Widened (trained) experts: the forward multiplies by their MXFP4, W's gradient is the
    unquantized product's."""
    rng = np.random.default_rng(3)
    w = jnp.asarray(rng.normal(size=(3, 64, 32)).astype(np.float32) * 0.1)     # [E, in, out]
    sizes = jnp.array([4, 5, 3], jnp.int32)
    x = jax.random.normal(jax.random.PRNGKey(4), (12, 64), jnp.float32)
    ct = jax.random.normal(jax.random.PRNGKey(5), (12, 32), jnp.float32)
    y, vjp = jax.vjp(lambda w_: expert_matmul_qat(x, w_, sizes), w)
    ids = np.repeat(np.arange(3), np.asarray(sizes))
    q = np.stack([dequantize_mxfp4_np(*quantize_mxfp4(np.asarray(w[e]).T)) for e in range(3)])  # [E, out, in]
    np.testing.assert_allclose(np.asarray(y), np.einsum("mk,mnk->mn", np.asarray(x), q[ids]), rtol=1e-5, atol=1e-6)
    _, pvjp = jax.vjp(lambda w_: expert_matmul(x, w_, sizes), w)
    np.testing.assert_allclose(np.asarray(vjp(ct)[0]), np.asarray(pvjp(ct)[0]), rtol=1e-6, atol=1e-7)


def test_merged_projection_is_the_exporters_bf16_merge():
    """Dense targets: bf16(W + s·A·B) in the forward, the exporter's fp32 merge then bf16."""
    import ml_dtypes
    rng = np.random.default_rng(6)
    w = rng.normal(size=(48, 40)).astype(np.float32)
    a = rng.normal(size=(48, 5)).astype(np.float32)
    b = rng.normal(size=(5, 40)).astype(np.float32) * 0.01
    got = np.asarray(jax.jit(merged_bf16, static_argnums=3)(w, a, b, 0.75))
    want = merged_fp32(w, a, b, 0.75)[0].astype(ml_dtypes.bfloat16).astype(np.float32)
    np.testing.assert_array_equal(got.view(np.uint32), want.view(np.uint32))
    # the rounding on the bits is the cast's (ties to even, subnormals, signed zeros)
    v = _hard_values(rng, (64, 128))
    v.flat[::7] = (v.flat[::7].view(np.uint32) & np.uint32(0xFFFF0000) | np.uint32(0x8000)).view(np.float32)
    got = np.asarray(jax.jit(round_bf16)(v))
    np.testing.assert_array_equal(got.view(np.uint32), v.astype(ml_dtypes.bfloat16).astype(np.float32).view(np.uint32))
