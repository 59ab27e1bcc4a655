"""The MXFP4 grouped matmul (k3jax.ops.mxfp4_matmul) against an independent reference: the
weights decoded by k3jax.checkpoint.mxfp4.dequantize_mxfp4_np, each row multiplied by its
group's weight in float64 NumPy. Both orientations, fp32 and bf16, groups that are empty,
longer than a row tile and rows past the last group; gradients against autodiff of the
dequantized product; and the pure path's compiled program holds one expert, not all."""
import functools
import re

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from k3jax.checkpoint.mxfp4 import dequantize_mxfp4, dequantize_mxfp4_np
from k3jax.ops.grouped_matmul import grouped_matmul
from k3jax.ops.mxfp4_matmul import decode_halves, mxfp4_grouped_matmul
from pallas_kernels.mxfp4_gmm import mxfp4_gmm
from reference import mxfp4_gmm_ref

BF16 = np.dtype(ml_dtypes.bfloat16)


def weights(rng, E, N, K, spread=6):
    """Random codes (all 16) under scales around 2**0, [E, N, K/2] and [E, N, K/32] bytes."""
    packed = rng.integers(0, 256, (E, N, K // 2), dtype=np.uint8)
    scale = rng.integers(127 - spread, 127 + spread, (E, N, K // 32), dtype=np.uint8)
    return packed, scale


def assert_close(got, want, dtype):
    """fp32: the DESIGN bar (1e-5 relative, on the output's scale). bf16: fp32 accumulation
    then one rounding to bf16, so each element within half a bf16 ulp (2**-8 relative) of
    the exact product, plus the fp32 allowance."""
    got = np.asarray(got).astype(np.float64)
    size = np.abs(want).max()
    if dtype == jnp.float32:
        assert np.abs(got - want).max() <= 1e-5 * size, np.abs(got - want).max() / size
    else:
        np.testing.assert_array_less(np.abs(got - want), 2.0**-8 * np.abs(want) + 1e-5 * size)


# One weight shape (compiled once per option set; the group sizes are traced), E experts of
# W [N, K], M rows: empty groups with rows past the last group; a group over several row
# tiles with every row used; a single group holding every row.
E, N, K, M = 5, 48, 96, 72
SIZES = [[0, 3, 17, 0, 20], [30, 0, 1, 9, 32], [0, 0, 72, 0, 0]]
# The CPU path (one expert a block, grouped_matmul's row tile), short windows that split
# groups, and blocks of experts through ragged_dot (the TPU/GPU path without Pallas).
CONFIGS = [(jnp.float32, {}), (jnp.bfloat16, {}), (jnp.float32, dict(window_rows=8)),
           (jnp.float32, dict(block_experts=3, window_rows=16)),
           (jnp.bfloat16, dict(block_experts=3, window_rows=16))]

gmm = jax.jit(mxfp4_grouped_matmul, static_argnames=(
    "transpose_rhs", "impl", "compute_dtype", "block_experts", "window_rows"))


def test_decode_is_bit_exact_for_every_code_and_scale():
    """Every byte (both nibbles, all 16 codes) under every scale byte, NaN and subnormal
    results included, in fp32 and bf16."""
    packed = np.tile(np.arange(256, dtype=np.uint8), (256, 1))          # [256 scales, 256 B]
    scale = np.repeat(np.arange(256, dtype=np.uint8)[:, None], 16, axis=1)
    for dtype, bits in ((jnp.float32, np.uint32), (jnp.bfloat16, np.uint16)):
        lo, hi = (np.asarray(h) for h in jax.jit(decode_halves, static_argnums=2)(packed, scale, dtype))
        got = np.stack([lo, hi], -1).reshape(256, 512)
        want = np.asarray(dequantize_mxfp4(packed, scale, dtype))
        np.testing.assert_array_equal(got.view(bits), want.view(bits))
        np.testing.assert_array_equal(got.view(bits), dequantize_mxfp4_np(packed, scale, np.dtype(dtype)).view(bits))


@pytest.mark.parametrize("transpose_rhs", [True, False])
def test_pure_matches_reference(transpose_rhs):
    rng = np.random.default_rng(int(transpose_rhs))
    packed, scale = weights(rng, E, N, K)
    x = rng.standard_normal((M, K if transpose_rhs else N)).astype(np.float32)
    for dtype, kw in CONFIGS:
        xd = jnp.asarray(x, dtype)
        for sizes in SIZES:
            s = np.array(sizes, np.int32)
            got = gmm(xd, packed, scale, s, transpose_rhs=transpose_rhs, **kw)
            want = mxfp4_gmm_ref(np.asarray(xd, np.float32), packed, scale, s, transpose_rhs)
            assert got.dtype == dtype and got.shape == want.shape
            assert_close(got, want, dtype)
            assert not np.asarray(got[sum(sizes):]).any()  # rows past the groups


def test_equals_grouped_matmul_of_the_dequantized_weights():
    """Against grouped_matmul on dequantize_mxfp4's weights: within fp32 rounding on random
    data; and bit for bit where every partial sum is exact in fp32 (small integers times
    multiples of 1/2), which shows that summation order is all that differs."""
    rng = np.random.default_rng(7)
    packed, scale = weights(rng, E, N, K, spread=1)        # scales 2**-1 .. 2**0
    s = np.array(SIZES[0], np.int32)
    w = dequantize_mxfp4(packed, scale, jnp.float32)
    for transpose_rhs in (True, False):
        d_in = K if transpose_rhs else N
        w_rhs = jnp.swapaxes(w, 1, 2) if transpose_rhs else w
        for x in (rng.standard_normal((M, d_in)).astype(np.float32),
                  rng.integers(-8, 9, (M, d_in)).astype(np.float32)):
            got = np.asarray(gmm(x, packed, scale, s, transpose_rhs=transpose_rhs))
            want = np.asarray(grouped_matmul(x, w_rhs, s))
            if np.all(x == np.round(x)):
                np.testing.assert_array_equal(got, want)
            else:
                assert np.abs(got - want).max() <= 1e-5 * np.abs(want).max()


@functools.partial(jax.jit, static_argnums=(5, 6))
def vjp_ct(x, packed, scale, s, ct, transpose_rhs, impl="auto"):
    f = functools.partial(mxfp4_grouped_matmul, transpose_rhs=transpose_rhs, impl=impl)
    return jax.vjp(f, x, packed, scale, s)[1](ct)


@jax.jit
def ref_grad(x, w, s, ct):
    """Autodiff of grouped_matmul on the dequantized weights, in fp32."""
    return jax.grad(lambda x: jnp.sum(grouped_matmul(x.astype(jnp.float32), w, s) * ct.astype(jnp.float32)))(x)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_gradient_wrt_x_matches_autodiff_of_the_dequantized_product(dtype):
    rng = np.random.default_rng(3)
    packed, scale = weights(rng, E, N, K)
    sizes = SIZES[0]
    s = np.array(sizes, np.int32)
    w = dequantize_mxfp4(packed, scale, jnp.float32)
    for transpose_rhs in (True, False):
        x = jnp.asarray(rng.standard_normal((M, K if transpose_rhs else N)), dtype)
        ct = jnp.asarray(rng.standard_normal((M, N if transpose_rhs else K)), dtype)
        w_rhs = jnp.swapaxes(w, 1, 2) if transpose_rhs else w
        dx, dp, dsc, dg = vjp_ct(x, packed, scale, s, ct, transpose_rhs)
        want = ref_grad(x, w_rhs, s, ct)
        assert dx.dtype == dtype
        assert_close(dx, np.asarray(want, np.float64), dtype)
        assert not np.asarray(dx[sum(sizes):]).any()
        # The base is frozen: integer inputs get symbolic-zero (float0) cotangents.
        for d, a in ((dp, packed), (dsc, scale), (dg, s)):
            assert d.dtype == jax.dtypes.float0 and d.shape == a.shape


@pytest.mark.slow
def test_pure_path_never_holds_every_expert_dequantized():
    """The compiled forward and backward hold at most one expert's decoded weights (CPU)
    or one block's (block_experts): no float buffer of more than that many elements, and
    XLA's temporaries stay below a quarter of all experts' fp32 bytes."""
    E, N, K, M = 16, 64, 256, 64
    args = (jax.ShapeDtypeStruct((M, K), jnp.float32), jax.ShapeDtypeStruct((E, N, K // 2), jnp.uint8),
            jax.ShapeDtypeStruct((E, N, K // 32), jnp.uint8), jax.ShapeDtypeStruct((E,), jnp.int32))
    all_experts = E * N * K * 4
    for block in (None, 4):
        def f(x, p, sc, g):
            return mxfp4_grouped_matmul(x, p, sc, g, block_experts=block)

        def loss(x, p, sc, g):
            return jnp.sum(f(x, p, sc, g) ** 2)

        held = N * K * (block or 1)  # decoded values one step may hold
        for fn in (f, jax.grad(loss)):
            compiled = jax.jit(fn).lower(*args).compile()
            floats = re.findall(r"\b(?:f32|bf16)\[([\d,]+)\]", compiled.as_text())
            biggest = max(int(np.prod([int(d) for d in dims.split(",")])) for dims in floats if dims)
            assert biggest <= held, (block, biggest, held)
            if block is None:  # (XLA:CPU's ragged_dot is dense over the block: not measured)
                temp = compiled.memory_analysis().temp_size_in_bytes
                assert temp < all_experts / 4, (temp, all_experts)


def test_pure_path_under_shard_map_with_its_type_check():
    """The MoE runs the matmul inside shard_map (check_vma on): each device its own rows,
    W's output rows split over `tensor`; dx then sums over the tensor shards."""
    rng = np.random.default_rng(6)
    packed, scale = weights(rng, E, 64, K)
    x = rng.standard_normal((2, M, K)).astype(np.float32)
    sizes = np.array([SIZES[0], SIZES[1]], np.int32)
    mesh = jax.make_mesh((2, 4), ("data", "tensor"))
    f = jax.shard_map(_local, mesh=mesh, **MESH_SPECS)
    put = lambda a, spec: jax.device_put(a, jax.sharding.NamedSharding(mesh, spec))  # noqa: E731
    args = [put(a, spec) for a, spec in zip((x, packed, scale, sizes), MESH_SPECS["in_specs"])]
    def loss(x, *w):
        y = f(x, *w)
        return jnp.sum(y**2), y

    (_, y), dx = jax.jit(jax.value_and_grad(loss, has_aux=True))(*args)
    w = dequantize_mxfp4_np(packed, scale, np.float32).astype(np.float64)
    for b in range(2):
        want = mxfp4_gmm_ref(x[b], packed, scale, sizes[b], True)
        assert_close(np.asarray(y)[b], want, jnp.float32)
        want_dx = np.zeros_like(want, shape=x[b].shape)  # d/dx of Σ y² = 2 y W_g per row
        for r, e in enumerate(np.repeat(np.arange(E), sizes[b])):
            want_dx[r] = 2 * want[r] @ w[e]
        assert_close(np.asarray(dx)[b], want_dx, jnp.float32)


def test_bad_inputs_raise_clear_errors():
    rng = np.random.default_rng(0)
    packed, scale = weights(rng, 2, 8, 64)
    x = np.zeros((4, 64), np.float32)
    s = np.array([2, 2], np.int32)
    with pytest.raises(TypeError, match="uint8"):
        mxfp4_grouped_matmul(x, packed.astype(np.int32), scale, s)
    with pytest.raises(ValueError, match="scale shape"):
        mxfp4_grouped_matmul(x, packed, scale[:, :, :1], s)
    with pytest.raises(ValueError, match=r"x must be \[M, 8\]"):
        mxfp4_grouped_matmul(x, packed, scale, s, transpose_rhs=False)
    with pytest.raises(ValueError, match="group_sizes"):
        mxfp4_grouped_matmul(x, packed, scale, s[:1])
    with pytest.raises(ValueError, match="unknown impl"):
        mxfp4_grouped_matmul(x, packed, scale, s, impl="triton")


# ---------------------------------------------------------------------------------------
# The Pallas kernels in interpret mode, both layouts (TPU: sequential visits with the
# decoded tile cached; Triton: independent programs, masked chunks).

fused = jax.jit(mxfp4_gmm, static_argnames=("transpose_rhs", "compute_dtype", "mode", "layout", "tm"))


@pytest.mark.parametrize("transpose_rhs", [True, False])
@pytest.mark.parametrize("layout", ["tpu", "triton"])
def test_pallas_matches_reference_and_pure_path(layout, transpose_rhs):
    """16-row tiles, so groups straddle tiles and span several. On the Triton layout's
    tiles (64 packed columns, 64 weight rows) N = 48 and K/2 = 48 are partial tiles."""
    rng = np.random.default_rng(10 + transpose_rhs)
    packed, scale = weights(rng, E, N, K)
    x = rng.standard_normal((M, K if transpose_rhs else N)).astype(np.float32)
    for dtype in (jnp.float32, jnp.bfloat16):
        xd = jnp.asarray(x, dtype)
        for sizes in SIZES:
            s = np.array(sizes, np.int32)
            got = fused(xd, packed, scale, s, transpose_rhs=transpose_rhs, mode="interpret",
                        layout=layout, tm=16)
            want = mxfp4_gmm_ref(np.asarray(xd, np.float32), packed, scale, s, transpose_rhs)
            assert got.dtype == dtype and got.shape == want.shape
            assert_close(got, want, dtype)
            assert not np.asarray(got[sum(sizes):]).any()
            pure = np.asarray(gmm(xd, packed, scale, s, transpose_rhs=transpose_rhs), np.float64)
            assert_close(got, pure, jnp.float32 if dtype == jnp.float32 else dtype)


def test_pallas_tpu_layout_over_several_weight_tiles():
    """The TPU layout's tiling where K3's shapes take it: x @ Wᵀ over 3 column tiles of 128
    (the decoded tile is rebuilt for each), x @ W over 2 tiles of 256 packed columns with
    k-tile-major scales."""
    rng = np.random.default_rng(5)
    n, k, sizes = 384, 1024, np.array([0, 30, 10], np.int32)
    packed, scale = weights(rng, 3, n, k)
    for transpose_rhs in (True, False):
        x = rng.standard_normal((48, k if transpose_rhs else n)).astype(np.float32)
        got = fused(x, packed, scale, sizes, transpose_rhs=transpose_rhs, mode="interpret", tm=16)
        assert_close(got, mxfp4_gmm_ref(x, packed, scale, sizes, transpose_rhs), jnp.float32)
        assert not np.asarray(got[40:]).any()


@pytest.mark.slow
def test_pallas_gradient_through_the_custom_vjp():
    """impl="pallas" (interpret mode on CPU): dx is the other orientation's kernel."""
    rng = np.random.default_rng(4)
    packed, scale = weights(rng, E, N, K)
    s = np.array(SIZES[0], np.int32)
    w = dequantize_mxfp4(packed, scale, jnp.float32)
    for transpose_rhs in (True, False):
        x = jnp.asarray(rng.standard_normal((M, K if transpose_rhs else N)), jnp.float32)
        ct = jnp.asarray(rng.standard_normal((M, N if transpose_rhs else K)), jnp.float32)
        dx = vjp_ct(x, packed, scale, s, ct, transpose_rhs, "pallas")[0]
        want = ref_grad(x, jnp.swapaxes(w, 1, 2) if transpose_rhs else w, s, ct)
        assert_close(dx, np.asarray(want, np.float64), jnp.float32)


# ---------------------------------------------------------------------------------------
# lowering for accelerators (as tests/ops/test_kda_engine.py does for KDA)


MESH_SPECS = dict(in_specs=(P("data"), P(None, "tensor", None), P(None, "tensor", None), P("data")),
                  out_specs=P("data", None, "tensor"))


def _local(x, packed, scale, sizes, **kw):
    """One device's rows (its block of a [2, m, ·] batch) times its slice of W's output rows,
    as the MoE dispatch's shard_map runs it (w1 split over `tensor`)."""
    return mxfp4_grouped_matmul(x[0], packed, scale, sizes[0], **kw)[None]


def _local_qat(x, packed, scale, sizes, a, b):
    """`_local` re-quantizing each expert's weight with its adapters (QAT's product)."""
    return mxfp4_grouped_matmul(x[0], packed, scale, sizes[0], merge=(a, b, 2.0))[None]


def _export(platform, qat: bool = False):
    """forward and dx, as the MoE's shard_map runs them (its vma check on): pallas_calls
    typed by the manual axes their inputs vary over. qat: the re-quantizing product, B
    split over `tensor` with the weights' output rows."""
    e, n, k, m = 4, 512, 256, 64
    checks = [jax.export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")]
    mesh = jax.make_mesh((2, 4), ("data", "tensor"))
    sh = lambda *spec: jax.sharding.NamedSharding(mesh, P(*spec))  # noqa: E731
    args = (jax.ShapeDtypeStruct((2, m, k), jnp.bfloat16, sharding=sh("data")),
            jax.ShapeDtypeStruct((e, n, k // 2), jnp.uint8, sharding=sh(None, "tensor", None)),
            jax.ShapeDtypeStruct((e, n, k // 32), jnp.uint8, sharding=sh(None, "tensor", None)),
            jax.ShapeDtypeStruct((2, e), jnp.int32, sharding=sh("data")))
    if qat:
        args += (jax.ShapeDtypeStruct((e, k, 4), jnp.float32, sharding=sh()),
                 jax.ShapeDtypeStruct((e, 4, n), jnp.float32, sharding=sh(None, None, "tensor")))
        specs = dict(in_specs=MESH_SPECS["in_specs"] + (P(), P(None, None, "tensor")),
                     out_specs=MESH_SPECS["out_specs"])
        f = jax.shard_map(_local_qat, **specs)
    else:
        f = jax.shard_map(_local, **MESH_SPECS)  # impl="auto": the kernels on TPU and GPU

    def loss(*a):
        return jnp.sum(f(*a).astype(jnp.float32) ** 2)

    from k3jax.aot.gpu import target   # traced for the platform: "auto" picks the kernels
    with target("tpu" if platform == "tpu" else "gpu"), jax.set_mesh(mesh):
        try:
            exp = jax.export.export(jax.jit(jax.grad(loss)), platforms=[platform], disabled_checks=checks)(*args)
        except (ImportError, NotImplementedError) as err:
            pytest.skip(f"this jaxlib cannot lower Pallas for {platform}: {type(err).__name__}: {err}")
    return [exp.mlir_module()]


def test_pallas_lowers_for_tpu():
    for text in _export("tpu"):  # forward and dx: both orientations' kernels
        assert "tpu_custom_call" in text
        assert "mxfp4_gmm_nt" in text and "mxfp4_gmm_nn" in text
    # Mosaic indexes in int32: the kernels keep their integers so under jax_enable_x64 too.
    jax.config.update("jax_enable_x64", True)
    try:
        assert all("mxfp4_gmm_nn" in text for text in _export("tpu"))
    finally:
        jax.config.update("jax_enable_x64", False)


def test_pallas_lowers_for_cuda():
    for text in _export("cuda"):
        assert "__gpu$xla.gpu.triton" in text
        assert "mxfp4_gmm_nt" in text and "mxfp4_gmm_nn" in text


@pytest.mark.parametrize("platform", ["tpu", "cuda"])
def test_requantizing_kernels_lower_for_tpu_and_cuda(platform):
    """QAT's product runs the re-quantizing kernels on both accelerators, forward and dx
    (Mosaic's on TPU, Triton's on GPUs), inside the MoE's shard_map."""
    for text in _export(platform, qat=True):
        assert ("tpu_custom_call" if platform == "tpu" else "__gpu$xla.gpu.triton") in text
        assert "mxfp4_qat_gmm_nt" in text and "mxfp4_qat_gmm_nn" in text
