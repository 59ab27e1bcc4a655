"""The CPU tiled grouped matmul against a per-row NumPy reference: outputs and gradients,
for groups that are empty, smaller than a tile, several tiles long, and rows left over
past the last group (the `ep` receive buffers have those)."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from k3jax.ops.grouped_matmul import _tiled, grouped_matmul, tile_rows
from reference import grouped_matmul_ref


CASES = [
    (40, [0, 3, 17, 0, 20]),        # empty groups, one < tile, all rows used
    (300, [130, 0, 1, 100, 9]),     # a group over two tiles; 60 rows past the groups
    (8, [8]),
]


@pytest.mark.slow
@pytest.mark.parametrize("m,sizes", CASES)
def test_tiled_matches_per_row_reference(m, sizes):
    rng = np.random.default_rng(m)
    x = rng.standard_normal((m, 24)).astype(np.float32)
    w = rng.standard_normal((len(sizes), 24, 20)).astype(np.float32)
    s = np.array(sizes, np.int32)
    for tile in (8, tile_rows(m, len(sizes))):
        got = np.asarray(jax.jit(_tiled, static_argnums=3)(x, w, s, tile))
        np.testing.assert_allclose(got, grouped_matmul_ref(x, w, s), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(grouped_matmul(x, w, s)), grouped_matmul_ref(x, w, s), rtol=1e-5, atol=1e-5)


@pytest.mark.slow
def test_gradients_match_reference():
    m, sizes = 50, np.array([20, 0, 9, 13], np.int32)
    rng = np.random.default_rng(1)
    x = rng.standard_normal((m, 16)).astype(np.float32)
    w = rng.standard_normal((4, 16, 12)).astype(np.float32)
    ct = rng.standard_normal((m, 12)).astype(np.float32)
    dx, dw = jax.grad(lambda x, w: jnp.sum(grouped_matmul(x, w, sizes) * ct), argnums=(0, 1))(x, w)
    # d/dx row r = ct_r w_gᵀ; d/dw_e = Σ_{r in e} x_rᵀ ct_r; rows past the groups get 0.
    want_dx = np.zeros_like(x, np.float64)
    want_dw = np.zeros_like(w, np.float64)
    r = 0
    for e, n in enumerate(sizes):
        want_dx[r:r + n] = ct[r:r + n] @ w[e].T
        want_dw[e] = x[r:r + n].T @ ct[r:r + n]
        r += n
    np.testing.assert_allclose(np.asarray(dx), want_dx, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(dw), want_dw, rtol=1e-5, atol=1e-5)
