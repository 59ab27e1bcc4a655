"""LoRA (issue 21): adapters against an independent merge of W + (alpha/r)·A·B, their
gradients against the chain rule through the merged weights, the frozen base in the
train step, and target resolution."""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import linen as nn

from k3jax import model as M
from k3jax.config import ConfigError
from k3jax.layout import layer_subpath
from k3jax import lora
from k3jax.train import config as tconf, muon, step as tstep

from helpers import rel_l2, small_toy
from reference import lora_merged_params

RUNTIME = dict(dtype="float32", param_dtype="float32", moe_dispatch="ragged", kda_impl="recurrent")


def _cfg(**runtime):
    """helpers.small_toy: layer 0 dense, then a scanned [KDA-MoE, MLA-MoE] pair twice, so
    every kind of target."""
    return small_toy(**{**RUNTIME, **runtime})


def _with_lora(cfg, **section):
    spec = lora.resolve({"rank": 2, "alpha": 3.0, **section}, cfg, M.abstract_params(cfg))
    return cfg.with_runtime(lora=spec)


def _randomise_adapters(params, seed=0):
    """Nonzero B (init gives zeros) so the adapters change the function."""
    rng = np.random.default_rng(seed)
    ad = jax.tree.map(lambda x: jnp.asarray(rng.normal(0, 0.3, x.shape), x.dtype), params[M.LORA_KEY])
    return {**params, M.LORA_KEY: ad}


def _target(keys) -> str:
    """The LoRA target of an adapter leaf's path (['groups', 'sub_0', ..., 'lora_a'])."""
    return layer_subpath(keys[:-1])


TOKENS = np.random.default_rng(3).integers(0, 256, (2, 24)).astype(np.int32)


@pytest.mark.slow
@pytest.mark.parametrize("expert_format,expert_mode", [("bf16", "per_expert"), ("mxfp4", "shared_a")])
def test_adapted_model_equals_merged_weights(expert_format, expert_mode):
    cfg = _with_lora(_cfg(expert_format=expert_format), expert_mode=expert_mode, expert_rank=3)
    params = _randomise_adapters(M.init_params(cfg, jax.random.PRNGKey(0)))
    got = M.forward(cfg, params, TOKENS)
    plain = _cfg()                     # widened experts, no adapters
    want = M.forward(plain, lora_merged_params(cfg, params), TOKENS)
    assert rel_l2(got, want) <= 1e-5, rel_l2(got, want)


@pytest.mark.slow
def test_lora_starts_as_the_base_and_keeps_the_base_stream():
    cfg = _cfg()
    cfgl = _with_lora(cfg)
    base = M.init_params(cfg, jax.random.PRNGKey(7))
    adapted = M.init_params(cfgl, jax.random.PRNGKey(7))
    for (p, x), y in zip(jax.tree_util.tree_leaves_with_path(base),
                         jax.tree.leaves({k: v for k, v in adapted.items() if k != M.LORA_KEY})):
        np.testing.assert_array_equal(x, y, err_msg=jax.tree_util.keystr(p))
    bs = [x for p, x in jax.tree_util.tree_leaves_with_path(adapted[M.LORA_KEY]) if "lora_b" in jax.tree_util.keystr(p)]
    assert bs and all(not np.any(np.asarray(b)) for b in bs)
    # op by op: each base-stream op runs the same kernel on the same inputs in both models and
    # the adapters add exact zeros, so the outputs are bitwise equal. (Compiled whole, XLA may
    # fuse a base matmul with its zero adapter term and tile it differently: an ulp apart.)
    # One short row: op by op, the recurrent KDA's Python loop runs once per token.
    fwd = lambda c, p: M.K3Model(c).apply(M.variables_of(p), TOKENS[:1, :8])  # noqa: E731
    with jax.disable_jit():
        np.testing.assert_array_equal(fwd(cfgl, adapted), fwd(cfg, base))


@pytest.mark.slow
def test_adapter_gradients_follow_the_chain_rule_through_the_merged_weights():
    """dA = s·dW·Bᵀ and dB = s·Aᵀ·dW, with dW the gradient of the merged model."""
    cfg = _with_lora(_cfg())
    params = _randomise_adapters(M.init_params(cfg, jax.random.PRNGKey(1)), seed=2)
    targets = np.roll(TOKENS, -1, axis=1)

    def loss(logits):
        return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits), targets[..., None], -1))

    fwd = lambda c, p: M.K3Model(c).apply(M.variables_of(p), TOKENS)  # noqa: E731
    # dW at the adapted forward itself: the gradient of the base weight the adapters add to
    # (W + s·B·A enters every product as W does), from the same backward as the adapters'
    # (one compile). The merged model's own dW equals it up to fp32 rounding of a second
    # forward (test_adapted_model_equals_merged_weights holds the forwards equal);
    # differencing two forwards through 13 layers measured 1.2e-4 on an AVX2 machine,
    # rounding, not the chain rule
    base = {k: v for k, v in params.items() if k != M.LORA_KEY}
    g_w, g_lora = jax.jit(jax.grad(lambda p, ad: loss(fwd(cfg, {**p, M.LORA_KEY: ad})), argnums=(0, 1)))(
        base, params[M.LORA_KEY])
    checked = 0
    for path, ga in jax.tree_util.tree_leaves_with_path(g_lora):
        keys = [k.key for k in path]
        if keys[-1] != "lora_a":
            continue
        node, ad = g_w, params[M.LORA_KEY]
        for k in keys[:-2]:
            node, ad = node[k], ad[k]
        dw = node[keys[-2]]
        dw = np.asarray(dw if keys[-2] in ("w1", "w2", "w3") else dw["kernel"], np.float64)
        a = np.asarray(ad[keys[-2]]["lora_a"], np.float64)
        b = np.asarray(ad[keys[-2]]["lora_b"], np.float64)
        s = cfg.runtime.lora.scale_of(_target(keys))
        want_a = s * dw @ np.swapaxes(b, -1, -2)
        want_b = s * np.swapaxes(a, -1, -2) @ dw
        node_g = g_lora
        for k in keys[:-1]:
            node_g = node_g[k]
        assert rel_l2(node_g["lora_a"], want_a) <= 1e-4, (keys, rel_l2(node_g["lora_a"], want_a))
        assert rel_l2(node_g["lora_b"], want_b) <= 1e-4, (keys, rel_l2(node_g["lora_b"], want_b))
        checked += 1
    assert checked >= len(cfg.runtime.lora.targets)   # every target, in every layer that has it


def _batch(cfg, B=2, T=16, seed=0):
    rng = np.random.default_rng(seed)
    tok = rng.integers(0, 256, (1, B, T)).astype(np.int32)
    return {"tokens": tok, "targets": np.roll(tok, -1, -1), "loss_mask": np.ones(tok.shape, np.float32),
            "segment_ids": np.ones(tok.shape, np.int32)}


@pytest.mark.slow
def test_train_step_trains_only_adapters_and_starts_at_the_base_loss():
    cfg = _cfg(moe_dispatch="dense")
    cfgl = _with_lora(cfg, expert_mode="shared_a")
    tc = tconf.resolve({"data": {"seq_len": 16, "batch_size": 2}, "balance": {"method": "exact"}})
    batch = _batch(cfg)

    def steps(c, params, n, section=None, freeze=()):
        o = {**tc["optimizer"], "freeze": list(freeze)}
        tx, groups = muon.build_optimizer(c, params, o, 10, section)
        fn = tstep.make_train_step(c, tc, tx, groups)
        state = tstep.init_state(params, tx, groups)
        out = []
        for _ in range(n):
            state, m = fn(state, batch)
            out.append(float(m["loss"]))
        return state, out

    # the base model's loss on the batch, from its forward in float64 NumPy: the first
    # adapted step must start there (B = 0)
    logits = np.asarray(M.forward(cfg, M.init_params(cfg, jax.random.PRNGKey(0)), batch["tokens"][0]), np.float64)
    shifted = logits - logits.max(-1, keepdims=True)
    logp = shifted - np.log(np.sum(np.exp(shifted), -1, keepdims=True))
    base_loss = -np.mean(np.take_along_axis(logp, batch["targets"][0][..., None], -1))
    p0 = M.init_params(cfgl, jax.random.PRNGKey(0))
    host = jax.tree.map(np.asarray, p0)
    # one layer position's router frozen in the same run: it keeps its bias, the other moves
    frozen = "groups/sub_1/block_sparse_moe/gate"
    state, losses = steps(cfgl, p0, 2, {"lr": 1e-2}, freeze=(frozen,))
    assert abs(losses[0] - base_loss) <= 1e-6 * abs(base_loss)
    # AdamW's two moments for the adapters and nothing else: no optimizer state for the base
    opt_values = sum(x.size for x in jax.tree.leaves(state.opt_state) if x.ndim)
    assert opt_values == 2 * sum(x.size for x in jax.tree.leaves(state.params[M.LORA_KEY]))
    moved = []
    for path, x in jax.tree_util.tree_leaves_with_path(state.params):
        name = jax.tree_util.keystr(path)
        before = host
        for k in path:
            before = before[k.key]
        if name.startswith(f"['{M.LORA_KEY}']"):
            if "lora_b" in name:
                assert np.any(np.asarray(x) != before), name            # adapters trained
        elif "e_score_correction_bias" in name and "'sub_1'" in name:
            np.testing.assert_array_equal(x, 0.0, err_msg=name)         # the frozen router
        elif "e_score_correction_bias" in name:
            assert np.any(np.asarray(x) != before), name                # Quantile Balancing still runs
            moved.append(name)
        else:
            np.testing.assert_array_equal(x, before, err_msg=name)      # the base never changes
    assert moved, "no unfrozen router bias in the toy"


def test_targets_resolve_or_name_the_problem():
    cfg = _cfg()
    ab = M.abstract_params(cfg)
    assert lora.resolve({"rank": 0}, cfg, ab) is None
    spec = lora.resolve({"rank": 4, "targets": ["*/self_attn/q_b_proj", "re:block_sparse_moe/w2$"]}, cfg, ab)
    assert spec.targets == {"self_attn/q_b_proj", "block_sparse_moe/w2"}
    with pytest.raises(ConfigError, match="matches no projection"):
        lora.resolve({"rank": 4, "targets": ["*/no_such_proj"]}, cfg, ab)
    with pytest.raises(ConfigError, match="in every layer that has it"):
        lora.resolve({"rank": 4, "targets": ["groups/sub_0/self_attn/q_proj"]}, cfg, ab)
    with pytest.raises(ConfigError, match="lora.rank"):
        lora.resolve({"rank": -1}, cfg, ab)
    with pytest.raises(ConfigError, match="unknown key"):
        lora.resolve({"rank": 4, "ranks": 3}, cfg, ab)
    # adapters shard like their base: logical axes carried on every leaf
    boxed = M.abstract_adapters(cfg.with_runtime(lora=spec))
    names = jax.tree.leaves(nn.get_partition_spec(boxed), is_leaf=lambda x: isinstance(x, jax.sharding.PartitionSpec))
    assert names and all(any(n is not None for n in spec_) for spec_ in names)


@pytest.mark.slow
@pytest.mark.parametrize("preset,dispatch", [("fsdp2_expert2_tensor2", "ep"), ("data8", "ragged")])
def test_mxfp4_experts_with_adapters_under_a_mesh_equal_dense(preset, dispatch):
    """MXFP4 stacks and per-expert / shared adapters through the sharded dispatches (their
    shard_map specs: experts over `expert`, the hidden over `tensor`) against `dense`, in
    value and in the gradients of the input and the adapters."""
    from k3jax.mesh import load_mesh, use_mesh
    from k3jax.layers.mlp import glu_activation
    from k3jax.ops import moe_dispatch as md
    from k3jax.ops.mxfp4 import MXFP4, quantize_mxfp4_jax

    cfg = _cfg()
    r = np.random.default_rng(4)
    N, E, k, H, F, R = 21, 8, 2, 64, 64, 3
    z = jnp.asarray(r.normal(size=(N, H)), jnp.float32)
    idx = jnp.asarray(np.stack([r.choice(E, k, replace=False) for _ in range(N)]), jnp.int32)
    w = jnp.asarray(r.random((N, k)), jnp.float32)
    q = lambda shape: MXFP4(*quantize_mxfp4_jax(jnp.asarray(r.normal(size=shape) / 8, jnp.float32)))  # noqa: E731
    weights = {"w1": q((E, F, H)), "w3": q((E, F, H)), "w2": q((E, H, F))}
    ad = {"w1": (jnp.asarray(r.normal(size=(E, H, R)), jnp.float32), jnp.asarray(r.normal(size=(E, R, F)), jnp.float32)),
          "w2": (jnp.asarray(r.normal(size=(F, R)), jnp.float32), jnp.asarray(r.normal(size=(E, R, H)), jnp.float32))}
    cfgl = cfg.with_runtime(lora=lora.resolve({"rank": R, "targets": ["*/block_sparse_moe/w[12]"]}, cfg,
                                              M.abstract_params(cfg)))

    def f(fn, z, ad):
        y = fn(cfgl, functools.partial(glu_activation, cfgl), z, idx, w, weights, ad)
        return jnp.sum(jnp.sin(y)), y
    grad = functools.partial(jax.value_and_grad, has_aux=True, argnums=(0, 1))
    # the dense oracle in float64: the sharded fp32 result is held to exact arithmetic, not
    # to a second fp32 result whose rounding (the CPU's dot kernels) differs by machine
    with jax.enable_x64(True):
        wide = lambda t: jax.tree.map(lambda x: jnp.asarray(np.asarray(x, np.float64)), t)  # noqa: E731
        (_, y0), g0 = grad(functools.partial(f, md.experts_dense))(wide(z), wide(ad))
        y0, g0 = np.asarray(y0), jax.tree.map(np.asarray, g0)
    mesh, rules = load_mesh(preset)
    with use_mesh(mesh, rules):
        (_, y), g = jax.jit(grad(functools.partial(f, md.DISPATCH[dispatch])))(z, ad)
    assert rel_l2(y, y0) <= 1e-5
    for a, b in zip(jax.tree.leaves(g), jax.tree.leaves(g0)):
        assert rel_l2(a, b) <= 1e-5


@pytest.mark.slow
def test_ep_exchange_in_chunks_equals_one_exchange():
    """A receive-buffer budget smaller than the dropless worst case runs each device's
    tokens through the exchange in chunks: same values and gradients as one exchange."""
    from k3jax.mesh import load_mesh, use_mesh
    from k3jax.layers.mlp import glu_activation
    from k3jax.ops import moe_dispatch as md

    cfg = _cfg()
    r = np.random.default_rng(5)
    N, E, k, H, F = 40, 8, 2, 16, 16
    z = jnp.asarray(r.normal(size=(N, H)), jnp.float32)
    idx = jnp.asarray(np.stack([r.choice(E, k, replace=False) for _ in range(N)]), jnp.int32)
    w = jnp.asarray(r.random((N, k)), jnp.float32)
    ws = {n: jnp.asarray(r.normal(size=s), jnp.float32) for n, s in
          (("w1", (E, H, F)), ("w3", (E, H, F)), ("w2", (E, F, H)))}
    mesh, rules = load_mesh("expert8")
    n_local = N // 8
    rows = md.ep_receive_rows(n_local * k, 8, 0.0)

    def run(budget_mib):
        c = cfg.with_runtime(ep_buffer_mib=budget_mib)
        f = lambda z, ws: jnp.sum(jnp.sin(md.experts_ep(c, functools.partial(glu_activation, c), z, idx, w, ws, {})))  # noqa: E731
        with use_mesh(mesh, rules):
            return jax.jit(jax.value_and_grad(f, argnums=(0, 1)))(z, ws)

    budget = rows * H * 4 / 2.5 / 2**20     # room for 2.5 chunks' receive rows
    assert md.ep_chunks(n_local, k, 8, H, 4, cfg.with_runtime(ep_buffer_mib=budget)) == 3
    (v1, g1), (v3, g3) = run(0.0), run(budget)   # 5 local tokens in 3 chunks: padded
    assert abs(float(v1) - float(v3)) <= 1e-5 * abs(float(v1))
    for a, b in zip(jax.tree.leaves(g3), jax.tree.leaves(g1)):
        assert rel_l2(a, b) <= 1e-5
