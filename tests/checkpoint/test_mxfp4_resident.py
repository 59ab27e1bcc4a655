"""MXFP4-resident routed experts (issue 21): Moonshot's MXFP4 fixture through the packed path,
convert/export keeping the bytes, and the planner's state bytes against a real LoRA run's."""
import pytest

import jax
import numpy as np

from k3jax.checkpoint.convert import convert
from k3jax.checkpoint.export import export
from k3jax.checkpoint.load import load_model_dir
from k3jax.checkpoint.safetensors_io import ShardedCheckpoint
from k3jax.cli import main
from k3jax.model import forward

from helpers import FIXTURES, assert_logits_match, need, rel_l2

F32 = {"param_dtype": "float32", "dtype": "float32"}


def _expert_leaves(params):
    return [(jax.tree_util.keystr(p), x) for p, x in jax.tree_util.tree_leaves_with_path(params)
            if any(f"'{w}'" in jax.tree_util.keystr(p) for w in ("w1", "w2", "w3"))]


@pytest.mark.slow
def test_logits_command_on_the_mxfp4_fixture(tmp_path, capsys):
    b = need(FIXTURES / "fixture_b")
    ids = np.load(b / "inputs.npy")
    np.save(tmp_path / "ids.npy", ids)
    assert main(["logits", str(b), "--tokens", str(tmp_path / "ids.npy"), "--out", str(tmp_path / "l.npy"),
                 "--expert-format", "mxfp4"]) == 0
    got = np.load(tmp_path / "l.npy")
    assert_logits_match(got, np.load(b / "logits.npy"))
    _, packed = load_model_dir(b, F32, expert_format="mxfp4")
    leaves = _expert_leaves(packed)
    assert leaves and all(x.dtype.itemsize == 1 for _, x in leaves)        # no widened expert anywhere
    # the dequantized path: the same model to fp32 reduction order
    k3, wide = load_model_dir(b, F32)
    assert rel_l2(got, forward(k3.text, wide, ids)) <= 1e-5


def test_convert_keeps_mxfp4_bytes_and_export_writes_them_back(tmp_path):
    b = need(FIXTURES / "fixture_b")
    manifest = convert(b, tmp_path / "orbax", expert_format="mxfp4")
    assert manifest["expert_format"] == "mxfp4" and not (tmp_path / "orbax" / "mxfp4_scales").exists()
    k3, restored = load_model_dir(tmp_path / "orbax", F32, expert_format="mxfp4")
    src = ShardedCheckpoint(b)
    name = "language_model.model.layers.9.block_sparse_moe.experts.5.w2"   # an unscanned layer
    w2 = dict(_expert_leaves(restored))["['layers_9']['block_sparse_moe']['w2']['weight_packed']"]
    np.testing.assert_array_equal(np.asarray(w2)[5], src.get(f"{name}.weight_packed"))
    # widened on load when asked: equal to reading the HF files widened
    _, wide = load_model_dir(tmp_path / "orbax", F32, expert_format="bf16")
    _, ref = load_model_dir(b, F32)
    for (p, x), y in zip(jax.tree_util.tree_leaves_with_path(wide), jax.tree.leaves(ref)):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y), err_msg=jax.tree_util.keystr(p))
    export(tmp_path / "orbax", tmp_path / "back")
    back = ShardedCheckpoint(tmp_path / "back")
    assert back.keys() == src.keys()
    for n in src.keys():
        assert back.get(n).tobytes() == src.get(n).tobytes(), n


@pytest.mark.slow
def test_planner_state_bytes_equal_a_lora_over_mxfp4_runs_arrays():
    """params + grads + optimizer per device as `k3jax plan` counts them, against the arrays
    a toy LoRA-over-MXFP4 train state really holds on a device of the mesh (gradients: the
    fp32 trained leaves the step differentiates, laid out like their params)."""
    from k3jax import lora
    from k3jax.mesh import load_mesh, load_preset, use_mesh
    from k3jax.model import init_params_sharded
    from k3jax.config import load
    from k3jax.model import abstract_params
    from k3jax.plan import PlanOptions, state_bytes
    from k3jax.train import config as tconf, muon, step as tstep
    from k3jax.train.loop import _sharded_state_and_step

    preset = "fsdp2_expert2_tensor2"
    cfg = load("toy").with_runtime(param_dtype="bfloat16", expert_format="mxfp4")
    cfg = cfg.with_runtime(lora=lora.resolve({"rank": 8}, cfg, abstract_params(cfg)))
    mesh = load_mesh(preset)
    tc = tconf.resolve({"lora": {"rank": 8}})
    with use_mesh(*mesh):
        params = init_params_sharded(cfg, jax.random.PRNGKey(0), *mesh)
        tx, groups = muon.build_optimizer(cfg, params, tc["optimizer"], 10, tc["lora"])
        state, _ = _sharded_state_and_step(mesh, params, tx, groups, lambda s, b: (s, {}), None)
    dev = jax.devices()[0]

    def on_device(tree):
        return sum(s.data.nbytes for x in jax.tree.leaves(tree) for s in x.addressable_shards if s.device == dev)

    trained, _ = tstep.split_trained(state.params, muon.trained_mask(groups))
    grads = sum(s.data.size * 4 for x in jax.tree.leaves(trained) for s in x.addressable_shards if s.device == dev)
    real = on_device(state.params) + grads + on_device(state.opt_state)
    planned = state_bytes(load("toy"), load_preset(preset),
                          PlanOptions(param_dtype="bfloat16", expert_format="mxfp4", lora_rank=8))
    total = planned["params"] + planned["grads"] + planned["optimizer"]
    assert abs(total - real) <= 0.05 * real, (planned, real)
    assert planned["params"] == on_device(state.params)


@pytest.mark.slow
def test_quantizing_widened_experts_on_load_is_announced(tmp_path, capsys):
    """Asking for MXFP4 experts from a checkpoint that stores them widened is lossy: the load
    says so on stderr (a widening load, which is exact, says nothing)."""
    b = need(FIXTURES / "fixture_b")
    convert(b, tmp_path / "wide", expert_format="bf16")
    capsys.readouterr()
    load_model_dir(tmp_path / "wide", F32, expert_format="bf16")
    assert "quantizing" not in capsys.readouterr().err
    load_model_dir(tmp_path / "wide", F32, expert_format="mxfp4")
    err = capsys.readouterr().err
    assert "stored as bf16; quantizing them to MXFP4 on load" in err and str(tmp_path / "wide") in err
