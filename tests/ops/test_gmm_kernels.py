"""The grouped-matmul kernels (pallas_kernels.gmm, interpret mode on CPU, both layouts) and
the differentiable op over them (k3jax.ops.grouped_matmul, impl="pallas") against
independent references: a per-row float64 NumPy product and `jax.lax.ragged_dot` with its
autodiff. Groups that are empty (their weight gradient must be exactly zero), shorter than
a row tile, over several row tiles, and rows past the last group (the `ep` receive buffer
has those); fp32 and bf16; inside the MoE's shard_map with its type check on; and the
lowering for TPU and CUDA holds the kernels and no ragged_dot."""
import re

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from k3jax.ops.grouped_matmul import grouped_matmul
from pallas_kernels.gmm import gmm, tgmm
from reference import grouped_matmul_ref

BF16 = np.dtype(ml_dtypes.bfloat16)
# K, N not multiples of any tile: the Triton layout masks its loads; M over 2 TPU row tiles.
M, K, N = 300, 48, 40
SIZES = [[130, 0, 1, 100, 9],      # a group over two tiles, an empty one, 60 rows past the groups
         [0, 0, 300, 0, 0],        # one group holds every row, four empty
         [0, 7, 0, 0, 0]]          # nearly everything past the groups


def weight_grad_ref(x, dy, sizes):
    """[E, K, N]: Σ over each group's rows of x_rᵀ dy_r, float64 (zero for an empty group)."""
    out = np.zeros((len(sizes), x.shape[1], dy.shape[1]))
    r = 0
    for e, n in enumerate(sizes):
        out[e] = x[r:r + n].astype(np.float64).T @ dy[r:r + n].astype(np.float64)
        r += n
    return out


def assert_close(got, want, dtype):
    """fp32: DESIGN's 1e-5 relative to the output's scale. bf16: fp32 accumulation then one
    rounding, so half a bf16 ulp (2**-8 relative) plus that allowance."""
    got = np.asarray(got, np.float64)
    size = np.abs(want).max()
    if dtype == jnp.float32:
        assert np.abs(got - want).max() <= 1e-5 * size, np.abs(got - want).max() / size
    else:
        np.testing.assert_array_less(np.abs(got - want), 2.0**-8 * np.abs(want) + 1e-5 * size)


def _data(rng, dtype):
    npd = np.float32 if dtype == jnp.float32 else BF16
    x = rng.standard_normal((M, K)).astype(npd)
    w = rng.standard_normal((len(SIZES[0]), K, N)).astype(npd)
    dy = rng.standard_normal((M, N)).astype(npd)
    return x, w, dy


@pytest.mark.parametrize("layout", ["tpu", "triton"])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_kernels_match_per_row_reference(layout, dtype):
    rng = np.random.default_rng(0)
    x, w, dy = _data(rng, dtype)
    run = jax.jit(lambda x, w, dy, s: (gmm(x, w, s, mode="interpret", layout=layout),
                                      gmm(dy, w, s, transpose_rhs=True, mode="interpret", layout=layout),
                                      tgmm(x, dy, s, mode="interpret", layout=layout)))
    for sizes in SIZES:
        s = np.array(sizes, np.int32)
        y, dx, dw = run(x, w, dy, s)
        assert_close(y, grouped_matmul_ref(x, w, s), dtype)
        assert_close(dx, grouped_matmul_ref(dy, np.swapaxes(w, 1, 2), s), dtype)
        want = weight_grad_ref(x, dy, s)
        assert_close(dw, want, dtype)
        assert not np.asarray(dw, np.float32)[s == 0].any()   # empty experts: exactly zero
        assert y.dtype == dx.dtype == dw.dtype == dtype


def test_op_values_and_gradients_equal_ragged_dot():
    """impl="pallas": value, dx and dW against jax.lax.ragged_dot and its autodiff."""
    rng = np.random.default_rng(1)
    x, w, dy = _data(rng, jnp.float32)

    def grads(fn, s):
        return jax.jit(jax.value_and_grad(lambda x, w: jnp.sum(fn(x, w, s) * dy), argnums=(0, 1)))(x, w)

    for sizes in SIZES:
        s = np.array(sizes, np.int32)
        got = grads(lambda x, w, s: grouped_matmul(x, w, s, impl="pallas"), s)
        want = grads(lambda x, w, s: jax.lax.ragged_dot(x, w, s, precision=jax.lax.Precision.HIGHEST), s)
        for g, r in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
            assert_close(g, np.asarray(r, np.float64), jnp.float32)
        assert not np.asarray(got[1][1])[s == 0].any()


def _local(x, w, sizes):
    """One device's rows and its experts (a [1, m, K] block of a batch, sizes [1, E/ep])."""
    return grouped_matmul(x[0], w, sizes[0], impl="pallas")[None]


@pytest.mark.slow
def test_op_inside_shard_map_with_its_type_check():
    """As the `ep` dispatch runs it: rows split over (data, expert), the experts over
    `expert`, their hidden over `tensor`; each weight's gradient sums its expert's rows
    over the data shards (the cast's transpose), each hidden shard its own columns."""
    rng = np.random.default_rng(2)
    m, E = 40, 4
    x = rng.standard_normal((4, m, K)).astype(np.float32)
    w = rng.standard_normal((E, K, N)).astype(np.float32)   # experts 0-1 on expert shard 0
    sizes = np.array([[20, 0], [3, 30], [0, 40], [1, 2]], np.int32)  # per (data, expert) block
    mesh = jax.make_mesh((2, 2, 2), ("data", "expert", "tensor"),
                         axis_types=(jax.sharding.AxisType.Auto,) * 3)
    specs = dict(in_specs=(P(("data", "expert")), P("expert", None, "tensor"), P(("data", "expert"))),
                 out_specs=P(("data", "expert"), None, "tensor"))
    # check_vma off: interpret mode cannot run the TPU layout's scalar-prefetched index maps
    # with typed operands on CPU (jax 0.10); the typed lowering is test_lowers_with_kernels_...
    f = jax.shard_map(_local, mesh=mesh, check_vma=False, **specs)
    ct = rng.standard_normal((4, m, N)).astype(np.float32)

    def loss(x, w):
        return jnp.sum(f(x, w, sizes) * ct)

    put = lambda a, spec: jax.device_put(a, jax.sharding.NamedSharding(mesh, spec))  # noqa: E731
    dx, dw = jax.jit(jax.grad(loss, argnums=(0, 1)))(put(x, specs["in_specs"][0]), put(w, specs["in_specs"][1]))
    want_dw = np.zeros(w.shape)
    for b in range(4):          # block b = (data b // 2, expert b % 2): experts 2(b%2), 2(b%2)+1
        ex = slice(2 * (b % 2), 2 * (b % 2) + 2)
        assert_close(np.asarray(dx)[b], grouped_matmul_ref(ct[b], np.swapaxes(w[ex], 1, 2), sizes[b]),
                     jnp.float32)
        want_dw[ex] += weight_grad_ref(x[b], ct[b], sizes[b])
    assert_close(dw, want_dw, jnp.float32)


def _export(platform):
    """Forward and backward of the op inside a shard_map, exported for `platform`."""
    mesh = jax.make_mesh((2, 4), ("data", "expert"), axis_types=(jax.sharding.AxisType.Explicit,) * 2)
    sh = lambda *spec: jax.sharding.NamedSharding(mesh, P(*spec))  # noqa: E731
    f = jax.shard_map(lambda x, w, s: grouped_matmul(x[0], w, s[0], expected_rows=64)[None], mesh=mesh,
                      in_specs=(P(("data", "expert")), P("expert"), P(("data", "expert"))),
                      out_specs=P(("data", "expert")))
    args = (jax.ShapeDtypeStruct((8, 256, 512), jnp.bfloat16, sharding=sh(("data", "expert"))),
            jax.ShapeDtypeStruct((16, 512, 256), jnp.bfloat16, sharding=sh("expert")),
            jax.ShapeDtypeStruct((8, 4), jnp.int32, sharding=sh(("data", "expert"))))
    checks = [jax.export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")]
    loss = lambda x, w, s: jnp.sum(f(x, w, s).astype(jnp.float32) ** 2)  # noqa: E731
    from k3jax.aot.gpu import target   # traced for the platform: "auto" picks the kernels
    with target("tpu" if platform == "tpu" else "gpu"), jax.set_mesh(mesh):
        try:
            exp = jax.export.export(jax.jit(jax.grad(loss, argnums=(0, 1))), platforms=[platform],
                                    disabled_checks=checks)(*args)
        except (ImportError, NotImplementedError) as err:
            pytest.skip(f"this jaxlib cannot lower Pallas for {platform}: {type(err).__name__}: {err}")
    return exp.mlir_module()


@pytest.mark.parametrize("platform,call", [("tpu", "tpu_custom_call"), ("cuda", "__gpu$xla.gpu.triton")])
def test_lowers_with_kernels_and_no_ragged_dot(platform, call):
    text = _export(platform)
    assert call in text
    for name in ("gmm", "gmm_nt", "tgmm"):   # forward, dx, dW
        assert re.search(rf'\b{name}\b', text), name
    ops = "\n".join(line.split(" loc(")[0] for line in text.splitlines() if not line.startswith("#loc"))
    assert "ragged_dot" not in ops


def test_tpu_cost_estimate_counts_expected_rows():
    """The declared FLOPs are the balanced rows' (64 a call), not the 256-row buffer's."""
    text = _export("tpu")
    flops = sorted(int(f) for f in re.findall(r'\\22flops\\22: ?(\d+)|"flops": ?(\d+)', text) for f in f if f)
    assert flops and set(flops) == {2 * 64 * 512 * 256}, flops


@pytest.mark.parametrize("layout", ["tpu", "triton"])
def test_rows_past_the_groups_never_leak(layout):
    """The `ep` receive buffer's rows past Σ sizes hold whatever: NaN there must not reach a
    real row's output or any expert's gradient (0 · NaN is NaN), and those rows come out 0."""
    rng = np.random.default_rng(3)
    x, w, dy = _data(rng, jnp.float32)
    s = np.array(SIZES[0], np.int32)
    used = s.sum()
    x[used:], dy[used:] = np.nan, np.nan
    y = gmm(x, w, s, mode="interpret", layout=layout)
    dw = tgmm(x, dy, s, mode="interpret", layout=layout)
    assert_close(y[:used], grouped_matmul_ref(x[:used], w, s), jnp.float32)
    assert not np.asarray(y[used:]).any()
    assert_close(dw, weight_grad_ref(x, dy, s), jnp.float32)
