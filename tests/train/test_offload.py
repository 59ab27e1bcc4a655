"""`runtime.optimizer_offload`: the optimizer state lives in the host's pinned memory between
updates (k3jax/train/offload.py). On 8 CPU devices under a mesh that splits data, fsdp and
experts: the steps are bit-identical to the state kept on the device, the state enters and
leaves every step in host memory, and it survives an Orbax checkpoint round trip there."""
import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest

from k3jax.config import load
from k3jax.mesh import load_mesh, use_mesh
from k3jax.model import init_params_sharded
from k3jax.testing.variants import write_variant
from k3jax.train import config as tconf, muon, objectives, step as tstep
from k3jax.train.loop import _sharded_state_and_step, accum_batch_shardings

B, T, A = 8, 16, 2


def kinds(tree) -> set:
    return {x.sharding.memory_kind for x in jax.tree.leaves(tree)}


def host(tree):
    return jax.tree.map(np.asarray, tree)


@pytest.mark.slow
def test_the_optimizer_state_in_host_memory_changes_no_step(tmp_path):
    path = write_variant(str(tmp_path / "one.yaml"), layers=("kda",), first_k_dense_replace=0)
    tc = tconf.resolve({}, {"data": {"seq_len": T, "batch_size": B, "grad_accum": A}})
    rng = np.random.default_rng(0)
    tokens = rng.integers(1, 200, (A, B, T), dtype=np.int32)
    batches = [{"tokens": tokens, "targets": np.roll(tokens, -1, -1), "segment_ids": np.ones_like(tokens),
                "loss_mask": np.ones((A, B, T), np.float32)}] * 3
    mesh = load_mesh("data2_fsdp2_expert2")
    runs = {}
    for offload in (False, True):
        cfg = load(path, param_dtype="bfloat16", dtype="bfloat16", moe_dispatch="ep", optimizer_offload=offload)
        with use_mesh(*mesh):
            params = init_params_sharded(cfg, jax.random.PRNGKey(0), *mesh)
            tx, groups = muon.build_optimizer(cfg, params, tc["optimizer"], 10)
            rows = accum_batch_shardings(mesh, objectives.batch_spec(cfg, tc))
            state, step = _sharded_state_and_step(mesh, params, tx, groups, tstep.make_train_step(cfg, tc, tx, groups),
                                                  rows, offload=offload)
            assert kinds(state.opt_state) == {"pinned_host" if offload else "device"}
            assert kinds(state.params) == {"device"}
            metrics = []
            for b in batches[:2]:
                state, m = step(state, b)
                metrics.append(host(m))
                assert kinds(state.opt_state) == {"pinned_host" if offload else "device"}
            if offload:   # an Orbax round trip keeps the state in host memory, and the next step the same
                with ocp.StandardCheckpointer() as ckpt:
                    ckpt.save(tmp_path / "ckpt", state)
                    ckpt.wait_until_finished()
                    restored = ckpt.restore(tmp_path / "ckpt",
                                            jax.tree.map(ocp.utils.to_shape_dtype_struct, state))
                assert kinds(restored.opt_state) == {"pinned_host"}
                jax.tree.map(np.testing.assert_array_equal, host(restored), host(state))
                state = restored
            state, m = step(state, batches[2])
            metrics.append(host(m))
        runs[offload] = (host(state), metrics)
    (dev_state, dev_metrics), (host_state, host_metrics) = runs[False], runs[True]
    assert [m["loss"] for m in dev_metrics] == [m["loss"] for m in host_metrics]
    jax.tree.map(np.testing.assert_array_equal, host_state, dev_state)
    assert dev_metrics[2]["loss"] < dev_metrics[0]["loss"]     # the steps did train (on one batch)
