"""The CLI's sharded train step lowered for CUDA on this CPU machine (`jax.export`) at the
b300x8 presets' device count (this session's 8 devices); benchmarks/compile/aot_gpu_lower.py lowers
train, prefill and decode for the larger presets (h200x64, b300x16) at theirs."""
import jax
import pytest

from k3jax.aot import gpu, programs
from k3jax.config import load_k3
from k3jax.plan import PlanOptions


def _check(exported, prog, args):
    """Lowered for CUDA on the preset's device count, the inputs' shardings carried into the
    exported module (Shardy's annotations) as the run gives them."""
    assert exported.platforms == ("cuda",)
    assert exported.nr_devices == prog.mesh.size
    got = [s.spec for s in exported.in_shardings_jax(prog.mesh)]
    want = [x.sharding.spec for x in jax.tree.leaves(args)]
    assert [tuple(g) for g in got] == [tuple(w) + (None,) * (len(g) - len(w)) for g, w in zip(got, want)]
    assert any(any(e is not None for e in g) for g in got)      # not all replicated


def _small_k3():
    """The toy's widths at two layers, KDA and MLA, both MoE: every kind a step lowers, at
    the least compile time (the scanned form is lowered by benchmarks/compile/aot_gpu_lower.py)."""
    import dataclasses
    k3 = load_k3("toy")
    kinds = ("kda", "mla")
    cfg = k3.text.replace(num_hidden_layers=2, first_k_dense_replace=0, hf_extra={}, hf_keys=(),
                          kda_layers=(1,), full_attn_layers=(2,))
    assert cfg.layer_kinds == kinds and set(cfg.ffn_kinds) == {"moe"}
    return dataclasses.replace(k3, text=cfg)


@pytest.mark.slow
def test_sharded_train_step_lowers_for_cuda_on_b300x8():
    """`k3jax train --mesh b300x8`'s step (its train preset, b300x8_train) for CUDA. The
    serving steps' lowering (they need a CPU compile of the prefill for their caches'
    shardings) is in benchmarks/compile/aot_gpu_lower.py, with the larger presets."""
    k3 = _small_k3()
    devices = jax.devices()[:8]
    with gpu.target("gpu"):
        train = programs.train_program(k3, "b300x8", devices, PlanOptions(batch=8, seq=32, optimizer="muon"))
    ex = gpu.export(train)
    _check(ex, train, train.args)
    # experts on the expert axis: the GPU program exchanges tokens with ragged_all_to_all
    # (the CPU program would use a padded all_to_all)
    assert "ragged_all_to_all" in ex.mlir_module()


@pytest.mark.parametrize("backend,blocks", [("gpu", 512), ("cpu", 128)])
def test_target_backend_picks_the_forms(backend, blocks):
    """What `gpu.target` changes while tracing: KDA's block length and MoE's exchange."""
    from k3jax.config import load
    from k3jax.ops import kda_chunk, moe_dispatch
    with gpu.target(backend):
        assert kda_chunk.block_tokens() == blocks
        assert moe_dispatch._a2a_mode(load("toy")) == ("ragged" if backend == "gpu" else "padded")
        assert moe_dispatch._a2a_mode(load("toy", ep_exchange="emulated")) == "emulated"



def test_a_compiled_step_takes_the_microbatches_it_was_given():
    """`k3jax compile --batch 16 --grad-accum 2`'s program is train's step with
    data.batch_size=8, data.grad_accum=2: its batch arrives as [2, 8, T], the layout
    placing each microbatch as a one-pass batch of 8 would be."""
    k3 = _small_k3()
    devices = jax.devices()[:8]
    prog = programs.train_program(k3, "b300x8", devices, PlanOptions(batch=16, grad_accum=2, seq=64, optimizer="muon"))
    one = programs.train_program(k3, "b300x8", devices, PlanOptions(batch=8, seq=64, optimizer="muon"))
    assert (prog.tc["data"]["batch_size"], prog.tc["data"]["grad_accum"], prog.batch) == (8, 2, 16)
    tokens, single = prog.args[1]["tokens"], one.args[1]["tokens"]
    assert tokens.shape == (2, 8, 64) and single.shape == (1, 8, 64)
    assert tokens.sharding.spec == single.sharding.spec and prog.mesh.shape == one.mesh.shape


@pytest.mark.slow
def test_a_grpo_step_takes_the_rollout_batch():
    """`k3jax compile --objective grpo --kl-beta B`'s program is train's GRPO update: its batch
    carries the rollout's advantages [A, B] and the old policy's and reference's per-target
    log-probs [A, B, T] beside the rows, placed as the rows are, and it lowers with them."""
    k3 = _small_k3()
    devices = jax.devices()[:8]
    prog = programs.train_program(k3, "b300x8", devices, PlanOptions(batch=8, seq=64, optimizer="muon",
                                                                    objective="grpo", kl_beta=0.05))
    assert prog.tc["objective"] == "grpo" and prog.tc["grpo"]["group_size"] == 8
    assert prog.tc["grpo"]["kl_beta"] == 0.05 and prog.tc["data"]["format"] == "chat"
    batch = prog.args[1]
    assert batch["advantages"].shape == (1, 8)
    for k in ("old_logp", "ref_logp"):
        assert batch[k].shape == (1, 8, 64) and batch[k].sharding.spec == batch["tokens"].sharding.spec
    text = prog.lower().as_text()      # it lowers with them, as the step's own arguments
    assert text.count("tensor<1x8x64xf32>") >= 3          # loss mask, old and reference log-probs
    assert "tensor<1x8xf32>" in text                      # the advantages
    # the rollout between updates: the engine's two step widths over min(64, 8) = 8 slots,
    # with the update's params and the caches laid out as the run's engine lays them
    from k3jax.infer.caches import cache_shardings
    chunk, decode = programs.rollout_programs(prog)
    assert (chunk.args[3].shape, decode.args[3].shape) == ((8, 32), (8, 1))
    assert decode.args[1] is prog.args[0].params and decode.args[2].lengths.shape == (8,)
    assert jax.tree.map(lambda x: x.sharding, decode.args[2]) == cache_shardings(decode.args[2], prog.mesh, prog.rules)
    assert "tensor<8x1xi32>" in decode.lower().as_text()
