"""Quantile Balancing on synthetic router scores."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from k3jax.train.balancing import expert_load, histogram, solve_exact, solve_hist


def scores(m, n, skew, seed=0):
    rng = np.random.default_rng(seed)
    return jax.nn.sigmoid(jnp.asarray(rng.normal(size=(m, n)) + np.linspace(-skew, skew, n), jnp.float32))


def load_with(s, b, k):
    return np.asarray(expert_load(jax.lax.top_k(s + b, k)[1], s.shape[1]))


@pytest.mark.parametrize("m,n,k,skew", [(1024, 8, 2, 2.0), (2048, 32, 4, 0.0), (2000, 16, 1, 1.0)])
def test_exact_gives_every_expert_mk_over_n(m, n, k, skew):
    s = scores(m, n, skew)
    b0 = jnp.zeros(n)
    before = load_with(s, b0, k)
    b = solve_exact(s, b0, k)
    after = load_with(s, b, k)
    q = m * k // n
    assert np.abs(before - q).max() > 10            # the incoming routing really is unbalanced
    assert np.abs(after - q).max() <= 1, after
    assert abs(float(jnp.mean(b))) < 1e-5           # re-centred


def test_padding_tokens_neither_count_nor_vote():
    m, n, k = 1024, 8, 2
    s = scores(m, n, 1.5, seed=3)
    valid = jnp.arange(m) < 800
    b = solve_exact(s, jnp.zeros(n), k, valid)
    idx = jax.lax.top_k(s + b, k)[1]
    load = np.asarray(expert_load(idx, n, valid))
    assert np.abs(load - 800 * k // n).max() <= 1


def test_histogram_estimator_reduces_imbalance_and_adds_across_shards():
    m, n, k = 4096, 16, 2
    s = scores(m, n, 2.0, seed=4)
    b0 = jnp.zeros(n)
    full = histogram(s, b0, k, bins=1000)
    halves = histogram(s[: m // 2], b0, k, bins=1000) + histogram(s[m // 2:], b0, k, bins=1000)
    np.testing.assert_array_equal(np.asarray(full), np.asarray(halves))   # microbatches / shards add up
    q = m * k // n
    b = solve_hist(full, b0, k)
    assert np.abs(load_with(s, b, k) - q).max() < 0.35 * np.abs(load_with(s, b0, k) - q).max()
