"""The whole text model: parity with Moonshot's code, causality, packing, scanning, counts."""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from helpers import FIXTURES, REFERENCE_CONFIG, assert_logits_match, need, small_toy
from k3jax import config as C
from k3jax import model as M
from k3jax.model import transformer
from k3jax.layout import layer_plan
from k3jax.errors import InputError
from k3jax.checkpoint.hf_params import load_hf_params, unflatten
from k3jax.checkpoint.names import layer_location, tensor_map
from k3jax.param_count import count_params

# ---------------------------------------------------------------------------------------
# Parity with Moonshot's own modeling code (../shared/fixtures, fp32)
# ---------------------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("fixture", ["fixture_a", "fixture_b"])
def test_logits_match_reference_fixture(fixture):
    d = need(FIXTURES / fixture)
    cfg = C.K3Config.from_hf(d / "config.json").text
    params = load_hf_params(cfg, d, dtype=np.float32)
    tokens = np.load(d / "inputs.npy")
    ref = np.load(d / "logits.npy")
    assert_logits_match(np.asarray(M.forward(cfg, params, tokens)), ref)


# ---------------------------------------------------------------------------------------
# Properties of the toy model (one compiled forward per shape, shared across tests)
# ---------------------------------------------------------------------------------------
TOY = C.load("toy", kda_chunk_size=16)


# causality and packing hold layer by layer: every layer kind and a repeated scan is enough
SMALL = small_toy(kda_chunk_size=16)


@functools.lru_cache(maxsize=None)
def toy_params(cfg=TOY):
    return M.init_params(cfg, jax.random.PRNGKey(0))


@functools.partial(jax.jit, static_argnums=0)
def run(cfg, params, tokens, segment_ids):
    return M.K3Model(cfg).apply({"params": params}, tokens, segment_ids)


def toy_tokens(shape, seed=0):
    return np.random.default_rng(seed).integers(0, TOY.vocab_size, shape, dtype=np.int32)


@pytest.mark.slow
def test_toy_is_causal():
    tokens = toy_tokens((1, 48))
    seg = np.zeros_like(tokens)
    base = np.asarray(run(SMALL, toy_params(SMALL), tokens, seg))
    for t in (0, 17, 47):
        changed = tokens.copy()
        changed[0, t] = (changed[0, t] + 1) % SMALL.vocab_size
        out = np.asarray(run(SMALL, toy_params(SMALL), changed, seg))
        np.testing.assert_array_equal(out[:, :t], base[:, :t])
        assert np.abs(out[:, t] - base[:, t]).max() > 1e-3  # the changed token itself does matter


@pytest.mark.slow
def test_packed_documents_equal_each_document_alone():
    a, b = toy_tokens((1, 29), 1), toy_tokens((1, 19), 2)
    packed = np.concatenate([a, b], axis=1)
    seg = np.array([[1] * 29 + [2] * 19], np.int32)
    out = np.asarray(run(SMALL, toy_params(SMALL), packed, seg))
    alone_a = np.asarray(run(SMALL, toy_params(SMALL), a, None))
    alone_b = np.asarray(run(SMALL, toy_params(SMALL), b, None))
    assert np.abs(out[:, :29] - alone_a).max() <= 1e-4 * np.abs(alone_a).max()
    assert np.abs(out[:, 29:] - alone_b).max() <= 1e-4 * np.abs(alone_b).max()


def relayout(params, src: C.ModelConfig, dst: C.ModelConfig):
    """Move every tensor from src's tree layout to dst's, through the checkpoint name map."""
    flat = {tuple(k.key for k in p): np.asarray(v) for p, v in jax.tree_util.tree_leaves_with_path(params)}
    shapes = M.param_shapes(dst)
    out = {tuple(k.key for k in p): np.zeros(s.shape, s.dtype) for p, s in jax.tree_util.tree_leaves_with_path(shapes)}
    for e_src, e_dst in zip(tensor_map(src), tensor_map(dst)):
        assert e_src.hf == e_dst.hf
        out[e_dst.path][e_dst.index] = flat[e_src.path][e_src.index]
    return unflatten(out)


@pytest.mark.slow
def test_scanned_groups_equal_unrolled_layers():
    unrolled = TOY.with_runtime(scan_layers=False)
    plan = layer_plan(TOY)
    assert plan.n_groups == 2 and plan.group == (("kda", "moe"),) * 3 + (("mla", "moe"),)
    assert layer_plan(unrolled).n_groups == 0
    tokens = toy_tokens((2, 24), 3)
    seg = np.zeros_like(tokens)
    ref = np.asarray(run(unrolled, relayout(toy_params(), TOY, unrolled), tokens, seg))
    out = np.asarray(run(TOY, toy_params(), tokens, seg))
    assert np.abs(out - ref).max() <= 1e-5 * np.abs(ref).max()


def test_k3_layer_plan_scans_kda_kda_kda_mla():
    cfg = C.load("k3")
    plan = layer_plan(cfg)
    assert plan.group == (("kda", "moe"),) * 3 + (("mla", "moe"),)
    assert plan.n_groups == 22 and plan.head == (0, 1, 2, 3) and plan.tail == (92,)
    assert layer_location(cfg, 4) == (("groups", "sub_0"), (0,))
    assert layer_location(cfg, 91) == (("groups", "sub_3"), (21,))
    assert layer_location(cfg, 92) == (("layers_92",), ())


def test_every_param_has_logical_axes():
    """Each param's declaration (`param_infos`) names every axis, and its shape and dtype are
    the plain shapes callers get (`param_shapes`)."""
    cfg = C.load("k3")
    infos = M.param_infos(cfg)
    is_info = lambda x: isinstance(x, M.ParamInfo)  # noqa: E731
    leaves = jax.tree_util.tree_leaves_with_path(infos, is_leaf=is_info)
    shapes = jax.tree.leaves(M.param_shapes(cfg))
    assert leaves and len(leaves) == len(shapes)
    for (path, info), s in zip(leaves, shapes):
        assert len(info.axes) == len(info.shape) and all(info.axes), jax.tree_util.keystr(path)
        assert info.shape == s.shape and info.dtype == s.dtype
        if path[0].key == "groups":
            assert info.axes[0] == "layers"


def test_a_profile_names_each_stage():
    """The lowered step carries the stage scopes a profile is read by: KDA, MLA, AttnRes,
    the router and the MoE dispatch, and under an expert mesh the 'ep' exchange (the toy's
    five-layer cut: every stage is there, in unrolled and scanned layers)."""
    from k3jax.mesh import batch_sharding, load_mesh, use_mesh

    def scopes(cfg, mesh=None):
        shapes, tokens = M.param_shapes(cfg), jax.ShapeDtypeStruct((8, 16), jnp.int32)
        if mesh is not None:
            place = lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh)  # noqa: E731
            shapes = jax.tree.map(place, shapes, M.param_shardings(cfg, *mesh))
            tokens = place(tokens, batch_sharding(*mesh))
        fn = jax.jit(lambda p, t: M.K3Model(cfg).apply(M.variables_of(p), t))
        return fn.lower(shapes, tokens).as_text(debug_info=True)
    text = scopes(SMALL)
    assert SMALL.use_attn_res
    for stage in ("kda", "mla", "attn_res", "moe_router", "moe_dispatch"):
        assert f"/{stage}/" in text, stage
    assert "moe_exchange" not in text
    mesh = load_mesh("expert8")
    with use_mesh(*mesh):     # inside the shard_map the scope starts the name
        assert '"moe_exchange/all_to_all"' in scopes(SMALL.with_runtime(moe_dispatch="ep"), mesh)


# ---------------------------------------------------------------------------------------
# Parameter counts (SPEC.md §1), from abstract shapes
# ---------------------------------------------------------------------------------------


def test_k3_parameter_counts_preset_and_real_config():
    for source in ("k3", need(REFERENCE_CONFIG)):
        k3 = C.load_k3(source)
        counts = count_params(k3.text, k3.layout)
        assert counts["total"] == 2_779_484_478_208
        assert counts["active"] == 104_189_614_848


def test_kimi_linear_parameter_counts():
    k = C.load_k3("kimi_linear_48b")
    counts = count_params(k.text, k.layout)
    assert 48e9 <= counts["total"] <= 50e9
    assert 2.9e9 <= counts["active"] <= 3.3e9


# ---------------------------------------------------------------------------------------
# Bad input fails before anything compiles
# ---------------------------------------------------------------------------------------


def test_bad_inputs_raise_before_compiling(monkeypatch):
    def no_compile(*a, **k):
        raise AssertionError("compiled before validating")
    monkeypatch.setattr(transformer, "_forward_jit", no_compile)
    params = {}
    with pytest.raises(InputError, match="outside the vocabulary"):
        M.forward(TOY, params, np.array([[1, TOY.vocab_size]], np.int32))
    with pytest.raises(InputError, match="outside the vocabulary"):
        M.forward(TOY, params, np.array([[-1, 2]], np.int32))
    with pytest.raises(InputError, match="max_position_embeddings"):
        M.forward(TOY, params, np.zeros((1, TOY.max_position_embeddings + 1), np.int32))
    with pytest.raises(InputError, match="integer"):
        M.forward(TOY, params, np.zeros((1, 4), np.float32))
    with pytest.raises(InputError, match="segment_ids"):
        M.forward(TOY, params, np.zeros((1, 4), np.int32), np.zeros((1, 5), np.int32))


def test_init_params_matches_the_module_tree():
    """The per-kind initialiser builds exactly the tree K3Model.init would."""
    params = toy_params()
    abstract = M.param_shapes(TOY)
    assert jax.tree.structure(params) == jax.tree.structure(abstract)
    for p, a in zip(jax.tree.leaves(params), jax.tree.leaves(abstract)):
        assert p.shape == a.shape and p.dtype == a.dtype
    q = params["groups"]["sub_0"]["self_attn"]["q_proj"]["kernel"]
    assert not np.allclose(q[0], q[1])  # every stacked layer draws its own values
