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


@pytest.mark.slow
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


@pytest.mark.slow
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


@pytest.mark.slow
def test_hist_method_through_the_train_step():
    """One jitted train step, method 'hist', two microbatches, from a skewed router bias:
    the bias it writes is solve_hist of the whole batch's histogram, built here from a plain
    forward pass's router scores (so microbatch histograms were summed, per layer), and it
    cuts the imbalance of the step's own tokens (re-run with zero learning rates, so only
    the bias changed). One histogram pass is an estimator, not the exact ±1 solve."""
    from flax import linen as nn

    from k3jax.config import K3Config
    from k3jax.model import K3Model, init_params
    from k3jax.train import balancing, muon, step as tstep
    from k3jax.train import config as tconf
    from k3jax.testing.variants import variant_dict

    d = variant_dict(layers=("kda", "kda"))
    d.pop("train", None)
    cfg = K3Config.from_hf(d).text.with_runtime(kda_impl="recurrent", moe_dispatch="dense")
    A, B, T = 2, 2, 32
    tc = tconf.resolve({}, {"data": {"seq_len": T, "batch_size": B, "grad_accum": A},
                            "balance": {"method": "hist"},
                            "optimizer": {"lr": 0.0, "adam_lr": 0.0}})
    params = nn.unbox(init_params(cfg, jax.random.PRNGKey(0)))
    (path,) = balancing.bias_paths(params)
    n, k = cfg.num_experts, cfg.num_experts_per_token
    b0 = jnp.linspace(-0.3, 0.3, n)
    params = balancing._replace(params, {path: b0})
    tx, groups = muon.build_optimizer(cfg, params, tc["optimizer"], 10)
    fn = tstep.make_train_step(cfg, tc, tx, groups)
    rng = np.random.default_rng(0)
    tok = rng.integers(3, 256, (A, B, T + 1)).astype(np.int32)
    batch = {"tokens": tok[..., :-1], "targets": tok[..., 1:], "segment_ids": np.ones((A, B, T), np.int32),
             "loss_mask": np.ones((A, B, T), np.float32)}

    def router(p):
        _, inter = K3Model(cfg).apply({"params": p}, batch["tokens"].reshape(A * B, T),
                                      batch["segment_ids"].reshape(A * B, T), mutable=["intermediates"])
        s, idx = balancing.layer_router_outputs(inter["intermediates"], path)
        return s.reshape(-1, n), np.asarray(expert_load(idx.reshape(-1, k), n))

    scores, before = router(params)
    want = solve_hist(histogram(scores, b0, k, bins=int(tc["balance"]["bins"])), b0, k)
    state, _ = fn(tstep.init_state(params, tx, groups), batch)   # donates params' buffers
    got = balancing._get(state.params, path)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-6)
    _, after = router(state.params)
    q = A * B * T * k // n
    assert np.abs(before - q).max() > 8, before     # the skewed bias really unbalances
    assert np.abs(after - q).max() < 0.5 * np.abs(before - q).max(), (before, after)
