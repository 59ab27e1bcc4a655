"""`k3jax plan`: full K3 from abstract shapes only (nothing of that size is allocated)."""
import dataclasses
import json
import math
import re

import pytest

from k3jax.cli import main
from k3jax.config import load
from k3jax.plan import GIB, PlanOptions, plan
from k3jax.mesh import load_preset


def run_json(capsys, *argv) -> dict:
    assert main(["plan", *argv, "--json"]) == 0
    return json.loads(capsys.readouterr().out.strip().splitlines()[-1])


def test_k3_plan_agrees_with_spec(capsys):
    out = run_json(capsys, "configs/k3.yaml", "--mesh", "v5p-1024", "--optimizer", "adamw", "--no-optimizer-offload")
    assert out["params"] == 2_779_484_478_208
    assert out["mla_cache_values_per_token"] == 24 * 576
    assert out["kda_state_values_per_sequence"] == 69 * 96 * 128 * 128
    assert isinstance(out["fits"], bool)
    # 2.78 T bf16 params over 512 chips: the sharding leaves (almost) nothing replicated
    per_device = out["bytes_per_device"]["params"]
    assert 2 * out["params"] / 512 <= per_device < 1.02 * 2 * out["params"] / 512
    # AdamW: fp32 m and v = 4x the bf16 params; gradients as the params
    assert out["bytes_per_device"]["optimizer"] == pytest.approx(4 * per_device, rel=0.01)


def test_fits_follows_hbm_and_muon_saves_state(capsys):
    small = run_json(capsys, "configs/k3.yaml", "--mesh", "v5p-1024", "--hbm-gib", "16", "--optimizer", "adamw")
    big = run_json(capsys, "configs/k3.yaml", "--mesh", "v5p-1024", "--hbm-gib", "4096", "--optimizer", "adamw")
    assert not small["fits"] and big["fits"]
    muon = run_json(capsys, "configs/k3.yaml", "--mesh", "v5p-1024")     # train's optimizer, the default
    assert muon["optimizer"] == "muon"
    assert muon["bytes_per_device"]["optimizer"] < 0.55 * big["bytes_per_device"]["optimizer"]


def test_remat_policies_and_inference_caches():
    cfg, preset = load("toy"), load_preset("data2_fsdp2_expert2")
    saved = {r: plan(cfg, preset, PlanOptions(remat=r, batch=8, seq=64), 1)["detail"]["activations"]["saved"]
             for r in ("none", "dots", "full")}
    assert saved["none"] > saved["dots"] > saved["full"] > 0
    inf = plan(cfg, preset, PlanOptions(mode="infer", batch=8, seq=64), 1)
    caches = inf["detail"]["caches"]
    # batch 8 over data 2 x fsdp 2 x expert 2: one sequence per device
    assert caches["kda_state"] == 9 * 4 * 16 * 16 * 4
    assert caches["mla_kv"] == 4 * (16 + 8) * 64 * 2
    assert "grads" not in inf["bytes_per_device"]


def test_mxfp4_experts_shrink_inference_params():
    cfg, preset = load("k3"), load_preset("b300x8")
    bf16 = plan(cfg, preset, PlanOptions(mode="infer", batch=8, seq=8192), 1)
    fp4 = plan(cfg, preset, PlanOptions(mode="infer", batch=8, seq=8192, expert_format="mxfp4"), 1)
    ratio = fp4["bytes_per_device"]["params"] / bf16["bytes_per_device"]["params"]
    assert 0.25 < ratio < 0.35 and fp4["fits"] and not bf16["fits"]


def test_presets_with_free_axis_need_a_device_count(capsys):
    assert main(["plan", "toy", "--mesh", "fsdp"]) == 2
    assert "device count" in capsys.readouterr().err
    out = run_json(capsys, "toy", "--mesh", "fsdp", "--devices", "16", "--hbm-gib", "1")
    assert out["devices"] == 16 and out["fits"]


@pytest.mark.slow
def test_ep_capacity_sizes_the_moe_buffer(capsys):
    """Dropless 'ep' holds expert-axis × the mean received pairs; a capacity factor c holds c ×.
    v5p-1024 has an expert axis of 64: with one exchange (no buffer budget) the buffer
    shrinks by 64 / c; with the default budget the tokens go through in chunks whose
    receive rows fit the budget."""
    def buffer(*flags):
        out = run_json(capsys, "configs/k3.yaml", "--mesh", "v5p-1024", *flags)
        return out["detail"]["activations"]["moe_buffer"]

    dropless = buffer("--ep-buffer-mib", "0")
    assert dropless / buffer("--ep-buffer-mib", "0", "--ep-capacity", "1.25") == pytest.approx(64 / 1.25)
    # a factor past the expert axis cannot hold more than every peer's pairs
    assert buffer("--ep-buffer-mib", "0", "--ep-capacity", "100") == dropless
    # chunked: the receive rows ([rows, latent] bf16) are the budget's at most
    cfg = load("configs/k3.yaml")
    # no tensor axis; training: the backward holds the recomputed buffers and their cotangents
    per_row = 2 * (2 * cfg.moe_hidden_size + 3 * cfg.moe_intermediate_size)
    chunked_rows = buffer("--ep-buffer-mib", "256") / 2 / per_row
    assert chunked_rows * cfg.moe_hidden_size * 2 <= 256 * 2**20 < dropless / 2 / per_row * cfg.moe_hidden_size * 2


def test_gathered_embedding_table_is_counted():
    """The lookup reads the table gathered along embed (layers/common.TokenEmbed); training
    adds the backward's whole fp32 table before it reduces onto the shards."""
    cfg = load("toy")
    V, D = cfg.vocab_size, cfg.hidden_size
    opts = dict(batch=8, seq=64, param_dtype="bfloat16")
    act = lambda mesh, mode: plan(cfg, load_preset(mesh), PlanOptions(mode=mode, **opts), 1)["detail"]["activations"]  # noqa: E731
    assert act("data2_fsdp2_expert2", "train")["embed_table"] == V * D * (2 + 4)
    assert act("data2_fsdp2_expert2", "infer")["embed_table"] == V * D * 2
    assert act("data8", "train")["embed_table"] == 0        # embed unsharded: nothing gathered
    # vocab over tensor: each device gathers only its vocab rows
    assert act("fsdp2_expert2_tensor2", "train")["embed_table"] == V // 2 * D * (2 + 4)


def test_saved_carry_is_what_the_backward_keeps():
    """The planner's saved residual carry (remat 'full': each layer's input partial sum and
    the AttnRes stacks a scanned group's layers share) against the arrays jax.vjp actually
    keeps for the backward of the toy model, params and their copies left out."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from k3jax import model
    from k3jax.plan import saved_carry_values
    cfg = load("toy").with_runtime(remat="full", moe_dispatch="dense")
    params = jax.eval_shape(lambda k: model.init_params(cfg, k), jax.random.PRNGKey(0))   # shapes only
    B, T = 3, 40        # [B, T, D] shapes no param has (params are told apart by shape)
    tokens = jnp.zeros((B, T), jnp.int32)
    # the residuals' shapes, traced only (eval_shape of the vjp closure): as jax.vjp keeps them
    vjp = jax.eval_shape(lambda p: jax.vjp(
        lambda p: jnp.sum(model.K3Model(cfg).apply({"params": p}, tokens)), p)[1], params)
    param_shapes = {x.shape for x in jax.tree.leaves(params)}
    kept = sum(int(np.prod(x.shape)) * x.dtype.itemsize for x in jax.tree.leaves(vjp)
               if x.shape not in param_shapes and len(x.shape))
    planned = saved_carry_values(cfg) * B * T * 4
    assert abs(planned - kept) <= 0.1 * kept, (planned, kept)


def test_too_few_sequences_for_the_batch_shards_take_the_context_preset(capsys):
    # v5p-1024 splits a batch 512 ways; 128 sequences can only run with each sequence split
    # over 4 chips, the layout `k3jax train --mesh v5p-1024` then uses (mesh.preset_for)
    from k3jax.mesh import batch_shards, preset_for
    assert batch_shards(load_preset("v5p-1024")) == 512
    assert preset_for("v5p-1024", "train", 128).name == "v5p-1024-cp4"
    assert preset_for("v5p-1024", "train", 512).name == "v5p-1024"
    assert preset_for("v5p-1024", "infer", 128).name == "v5p-1024"
    few = run_json(capsys, "configs/k3.yaml", "--mesh", "v5p-1024", "--batch", "128")
    cp4 = run_json(capsys, "configs/k3.yaml", "--mesh", "v5p-1024-cp4", "--batch", "128")
    assert few["mesh"] == "v5p-1024-cp4" and few["bytes_per_device"] == cp4["bytes_per_device"]
    assert run_json(capsys, "configs/k3.yaml", "--mesh", "v5p-1024", "--batch", "512", "--grad-accum", "1")["mesh"] \
        == "v5p-1024"


def test_every_context_preset_keeps_the_devices_and_the_weight_sharding():
    """A context preset runs a batch its parent cannot split: the same devices, the batch split
    fewer ways by exactly its context axis, and every weight axis sharded as many ways (ZeRO
    over context as over fsdp), so the planned state per device is the parent's."""
    import pathlib

    from k3jax.mesh import LOGICAL_AXES, MESH_DIR, batch_shards, logical_shards, preset_for
    parents = [load_preset(p.stem) for p in sorted(pathlib.Path(MESH_DIR).glob("*.yaml"))]
    parents = [p for p in parents if p.context_preset]
    assert {p.name for p in parents} >= {"v5p-1024", "v5p-1024x2", "h200x16_train"}
    for parent in parents:
        cp = load_preset(parent.context_preset)
        n = math.prod(parent.shape().values())
        sizes, cp_sizes = parent.shape(n), cp.shape(n)
        assert math.prod(cp_sizes.values()) == n, cp.name
        assert cp_sizes["context"] > 1 and batch_shards(cp, n) * cp_sizes["context"] == batch_shards(parent, n)
        weight_axes = [a for a in LOGICAL_AXES if a not in ("batch", "length")]
        for axis in weight_axes:
            assert logical_shards(cp.rules, cp_sizes, (axis,)) == logical_shards(parent.rules, sizes, (axis,)), \
                (parent.name, axis)
        few = batch_shards(cp, n)
        assert preset_for(parent.name, "train", few, n).name == cp.name


def test_zero3_gathers_one_layer_and_the_lm_head():
    """ZeRO-3 gathers a layer's weights over their sharded input side (the routed experts
    stay split over expert, heads and hidden over tensor) and the lm_head over embed;
    training holds the gathered gradients too. Serving layouts gather nothing."""

    from k3jax.model import param_shapes
    cfg = load("toy")
    V, D = cfg.vocab_size, cfg.hidden_size
    opts = dict(batch=8, seq=64, param_dtype="bfloat16")
    act = lambda mesh, mode, **kw: plan(cfg, load_preset(mesh), PlanOptions(mode=mode, **opts, **kw), 1)[  # noqa: E731
        "detail"]["activations"]
    train, infer = act("fsdp2_expert2_tensor2", "train"), act("fsdp2_expert2_tensor2", "infer")
    assert train["lm_head_table"] == infer["lm_head_table"] == V // 2 * D * 2     # vocab stays over tensor
    assert train["gathered_layer"] == 2 * infer["gathered_layer"] > 0
    assert act("fsdp2_expert2_tensor2", "train", lora_rank=4)["gathered_layer"] == infer["gathered_layer"]
    # an MoE layer holds at least its local experts whole over fsdp: E/2 experts, hidden/2
    p = param_shapes(cfg)
    moe = next(k for k in p if k.startswith("layers_") and "block_sparse_moe" in p[k])
    experts = sum(math.prod(p[moe]["block_sparse_moe"][w].shape) * 2 / 4 for w in ("w1", "w2", "w3"))
    assert infer["gathered_layer"] >= experts
    serve = act("b300x8", "infer")
    assert serve["gathered_layer"] == 0 and serve["lm_head_table"] == 0


def test_cache_heads_split_as_far_as_they_divide(tmp_path):
    # serving rules put heads over [expert, tensor]; the toy's 4 KDA heads divide expert 2
    # but not expert 2 x tensor 4, so the state is placed 2 ways (mesh.fit_spec), as
    # K3's 96 heads split 32 ways on v5p-256-serve (XLA's caches there: 7.16 GiB)
    (tmp_path / "serve_e2_t4.yaml").write_text("ici: {expert: 2, tensor: 4}\nrules: serve\n")
    cfg = load("toy")
    inf = plan(cfg, load_preset(str(tmp_path / "serve_e2_t4.yaml")), PlanOptions(mode="infer", batch=3, seq=64), 1)
    assert inf["detail"]["caches"]["kda_state"] == 3 * 9 * 4 * 16 * 16 * 4 // 2


def test_rollout_caches_split_their_rows_as_far_as_the_axes_divide(tmp_path):
    # 4 slots over fsdp 2 x expert 4: the rows go over expert alone (4 ways), not over the
    # prefix fsdp (2 ways), which would copy every cache to half the mesh; the planner
    # counts the state the engine places there, read from the placed arrays' shards
    import jax
    from k3jax.infer.caches import cache_shardings, init_cache
    from k3jax.mesh import load_mesh, row_axes
    assert row_axes(64, ("data", "fsdp", "expert"), {"data": 1, "fsdp": 2, "expert": 64}) == ("expert",)
    assert row_axes(6, ("fsdp", "expert"), {"fsdp": 2, "expert": 4}) == ("fsdp",)
    assert row_axes(3, ("fsdp", "expert"), {"fsdp": 2, "expert": 4}) == ()
    (tmp_path / "f2_e4.yaml").write_text("ici: {fsdp: 2, expert: 4}\nrules: zero3\n")
    cfg, preset = load("toy"), load_preset(str(tmp_path / "f2_e4.yaml"))
    mesh, rules = load_mesh(preset)
    cache = init_cache(cfg, 4, 64)
    placed = jax.device_put(cache, cache_shardings(cache, mesh, rules))
    states = [x for p, x in jax.tree_util.tree_leaves_with_path(placed.layers) if p[-1].key == "state"]
    per_device = sum(x.addressable_shards[0].data.nbytes for x in states)
    assert per_device * 4 == sum(x.nbytes for x in states)
    got = plan(cfg, preset, PlanOptions(mode="infer", batch=4, seq=64), 8)["detail"]["caches"]["kda_state"]
    assert got == per_device


def test_training_ep_buffers_hold_the_backward_and_the_expert_adapters():
    """A rematerialised exchange chunk's backward holds its recomputed buffers and their
    cotangents (2x serving's); LoRA on the routed experts adds its deltas' outputs."""
    from k3jax.plan import ep_rows
    cfg = load("toy")
    preset = load_preset("data2_fsdp2_expert2")
    opts = dict(batch=8, seq=64, param_dtype="bfloat16")
    moe = lambda **kw: plan(cfg, preset, PlanOptions(**opts, **kw), 1)["detail"]["activations"]["moe_buffer"]  # noqa: E731
    H, F = cfg.moe_hidden_size, cfg.moe_intermediate_size
    tokens = 8 * 64 / 8                                   # batch over data x fsdp x expert
    rows = ep_rows(cfg, tokens, 2, 2)
    assert moe(mode="infer", prefill_chunk=tokens) == rows * (2 * H + 3 * F) * 2
    assert moe(mode="train") == 2 * rows * (2 * H + 3 * F) * 2
    attention_only = moe(mode="train", lora_rank=4, lora_targets=("*/self_attn/*_proj",))
    with_experts = moe(mode="train", lora_rank=4)
    assert attention_only == moe(mode="train")
    assert with_experts - attention_only == rows * (2 * F + H) * 2


@pytest.mark.parametrize("flags,said", [
    (["--batch", "-8"], "--batch -8: global sequences must be >= 1"),
    (["--batch", "0"], "--batch 0: global sequences must be >= 1"),
    (["--seq", "0"], "--seq 0: tokens per sequence must be >= 1"),
    (["--hbm-gib", "-5"], "--hbm-gib -5.0: per-device memory must be > 0"),
    (["--ep-capacity", "-1"], "--ep-capacity -1.0: must be >= 0"),
    (["--lora-rank", "-2"], "--lora-rank -2: must be >= 0"),
    (["--batch", "7"], "batch 7 does not split over the 128 batch shards of mesh v5p-1024-cp4: give a multiple of 128"),
    (["--batch", "100", "--mesh", "data8"], "batch 100 does not split over the 8 batch shards of mesh data8"),
    (["--batch", "128", "--grad-accum", "3"], "--grad-accum 3: must divide --batch 128"),
    (["--batch", "256", "--grad-accum", "4"],
     "--grad-accum 4: microbatches of 64 sequences do not split over the 128 batch shards of mesh v5p-1024-cp4"),
    (["--grad-accum", "0"], "--grad-accum 0: microbatches a step must be >= 1"),
])
def test_bad_numbers_are_one_line_errors(flags, said, capsys):
    """Every numeric flag range-checked and the batch placed on the mesh's batch shards before
    anything is planned: exit 2 and one line, never a negative 'fits: yes'."""
    mesh = [] if "--mesh" in flags else ["--mesh", "v5p-1024"]
    assert main(["plan", "k3", *mesh, *flags]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and said in err, err


LORA_B300 = ("configs/k3.yaml", "--mesh", "b300x8", "--mode", "train", "--expert-format", "mxfp4",
             "--lora-rank", "16", "--batch", "8", "--seq", "4096")


def test_a_preset_carries_the_runtime_it_was_planned_with(capsys):
    """b300x8_train was planned with 256 MiB exchanges: the short command fits with it, says
    so, and a flag still wins (the same rule train and compile follow)."""
    on_device = (*LORA_B300, "--no-optimizer-offload")
    short = run_json(capsys, *on_device)
    assert short["mesh"] == "b300x8_train" and short["runtime_from_preset"] == {"ep_buffer_mib": 256}
    assert short["ep_buffer_mib"] == 256 and short["fits"]
    explicit = run_json(capsys, *on_device, "--ep-buffer-mib", "256")
    assert explicit["runtime_from_preset"] == {} and explicit["bytes_per_device"] == short["bytes_per_device"]
    wide = run_json(capsys, *on_device, "--ep-buffer-mib", "1024")
    assert wide["ep_buffer_mib"] == 1024 and not wide["fits"]


@pytest.mark.parametrize("argv", [
    LORA_B300 + ("--ep-buffer-mib", "1024", "--no-optimizer-offload"),
    ("configs/k3.yaml", "--mesh", "v5p-1024", "--batch", "128", "--optimizer", "adamw", "--no-optimizer-offload"),
    ("configs/k3.yaml", "--mesh", "h200x16_train", "--mode", "train", "--expert-format", "mxfp4",
     "--lora-rank", "16", "--batch", "8", "--seq", "4096", "--no-optimizer-offload"),
    ("configs/k3.yaml", "--mesh", "v5p-512", "--batch", "256", "--optimizer", "adamw", "--no-optimizer-offload"),
])
def test_a_plan_that_does_not_fit_names_what_would(capsys, argv):
    """Every setting the planner suggests fits when given; where it suggests none, even all of
    its levers together do not."""
    argv = (*argv, "--grad-accum", "1")     # one pass: microbatches are one of the levers
    out = run_json(capsys, *argv)
    assert not out["fits"]
    for hint in out["would_fit_with"]:
        flags = [t for pair in re.findall(r"(--[a-z-]+)(?: ([^\s(;-][^\s(;]*))?", hint) for t in pair if t]
        assert flags, hint
        assert run_json(capsys, *argv, *flags)["fits"], hint
    if not out["would_fit_with"]:
        everything = ("--ep-buffer-mib", "64", "--optimizer", "muon", "--remat", "full", "--optimizer-offload")
        assert not run_json(capsys, *argv, *everything)["fits"]


def test_a_batch_too_large_for_one_pass_runs_as_the_fewest_microbatches_that_fit(capsys):
    """K3 LoRA over MXFP4 at 2048 x 4096 on v5p-1024 (16K tokens a chip) does not fit as one
    pass; the plan runs it as microbatches (data.grad_accum), the fewest that fit, each
    planned as the one-pass batch of its size plus the accumulation: an fp32 running sum."""
    lora = ("configs/k3.yaml", "--mesh", "v5p-1024", "--batch", "2048", "--expert-format", "mxfp4",
            "--lora-rank", "16", "--ep-buffer-mib", "256", "--no-optimizer-offload")
    out = run_json(capsys, *lora)
    a, micro = out["grad_accum"], out["microbatch"]
    assert out["fits"] and a > 1 and a * micro == 2048 and out["batch"] == 2048
    assert out["chosen"] == {"grad_accum": a}
    from k3jax.plan_choices import CHOICE_MARGIN
    assert out["bytes_per_device"]["total"] <= CHOICE_MARGIN * out["hbm_bytes"]

    def plan_of(argv, accum):
        if main(["plan", *argv, "--grad-accum", str(accum), "--json"]) != 0:
            assert "do not split" in capsys.readouterr().err      # the mesh cannot place it
            return None
        return json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    fewer = [plan_of(lora, d) for d in range(1, a) if 2048 % d == 0]
    assert all(p["bytes_per_device"]["total"] > CHOICE_MARGIN * p["hbm_bytes"] for p in fewer if p)
    one = run_json(capsys, *lora[:3], "--batch", str(micro), *lora[5:], "--grad-accum", "1")
    assert out["mesh"] == one["mesh"] and out["detail"]["activations"] == one["detail"]["activations"]
    state, one_state = out["detail"]["state"], one["detail"]["state"]
    # the fp32 running sum: the gradient's size again
    assert state["accumulation"] == one_state["grads"] and "accumulation" not in one_state
    assert out["bytes_per_device"]["total"] - one["bytes_per_device"]["total"] == state["accumulation"]
    assert run_json(capsys, *lora, "--grad-accum", str(a))["bytes_per_device"] == out["bytes_per_device"]


def test_full_fine_tuning_at_16k_tokens_a_chip_keeps_the_optimizer_state_in_host_memory(capsys):
    """Full K3 fine-tuning at 2048 x 4096 on v5p-1024 fits no microbatch count with the
    optimizer state on the device (the fp32 gradient sum alone is 20 GiB a chip); the plan
    chooses runtime.optimizer_offload, which moves exactly that state to the host, and of
    the settings tried before it (fewer microbatches, the state on the device, a larger
    exchange buffer) none fits within the choosing margin."""
    from k3jax.plan_choices import CHOICE_MARGIN, EP_BUFFER_CHOICES
    full = ("configs/k3.yaml", "--mesh", "v5p-1024", "--batch", "2048")
    out = run_json(capsys, *full)
    a, chosen = out["grad_accum"], out["chosen"]
    assert out["fits"] and chosen["optimizer_offload"] is True and out["optimizer_offload"]
    assert chosen == {"grad_accum": a, "ep_buffer_mib": out["ep_buffer_mib"], "optimizer_offload": True}
    on_device = run_json(capsys, *full, "--grad-accum", str(a), "--ep-buffer-mib", str(out["ep_buffer_mib"]),
                         "--no-optimizer-offload")
    assert out["host_bytes_per_device"] == {"optimizer": on_device["bytes_per_device"]["optimizer"]}
    assert out["bytes_per_device"]["optimizer"] == 0
    assert out["bytes_per_device"]["total"] <= CHOICE_MARGIN * out["hbm_bytes"]

    def total(accum, mib, offload):
        flags = ["--grad-accum", str(accum), "--ep-buffer-mib", str(mib),
                 "--optimizer-offload" if offload else "--no-optimizer-offload"]
        if main(["plan", *full, *flags, "--json"]) != 0:
            assert "do not split" in capsys.readouterr().err
            return math.inf
        return json.loads(capsys.readouterr().out.strip().splitlines()[-1])["bytes_per_device"]["total"]
    limit = CHOICE_MARGIN * out["hbm_bytes"]
    mibs = (1024, *EP_BUFFER_CHOICES)
    assert all(total(d, mib, off) > limit for d in (1, 2, 4, 8) if d < a for mib in mibs for off in (False, True))
    assert all(total(a, mib, False) > limit for mib in mibs)
    assert all(total(a, mib, True) > limit for mib in mibs if mib > out["ep_buffer_mib"])


def test_objectives_add_the_reference_and_the_rollout_caches(capsys):
    """GRPO's rollout holds the engine's caches for its slots (the cache pytree the engine
    allocates, split over the batch shards) while the params and optimizer state stay; a KL
    reference without LoRA is a second copy of the params; the plan's total is the larger of
    the update and the rollout. DPO adds only the reference's per-target log-probs."""
    import jax

    from k3jax.infer.caches import init_cache
    cfg, preset = load("toy"), load_preset("data8")
    opts = dict(batch=16, seq=64, param_dtype="bfloat16")
    sft = plan(cfg, preset, PlanOptions(**opts), 1)
    grpo = plan(cfg, preset, PlanOptions(**opts, objective="grpo", rollout_slots=24), 1)
    run = cfg.with_runtime(dtype="bfloat16", param_dtype="bfloat16")
    engine = jax.eval_shape(lambda: init_cache(run, 24, 64))
    per_slot_bytes = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(engine.layers))
    extra = grpo["detail"]["objective"]
    assert extra["rollout_caches"] == per_slot_bytes // 8            # 24 sequences over 8 batch shards
    b = grpo["bytes_per_device"]
    assert extra["rollout_total"] == b["params"] + b["optimizer"] + b["reference"] + extra["rollout_peak"]
    assert b["total"] == max(sum(v for k, v in b.items() if k != "total"), extra["rollout_total"])
    assert b["reference"] == 0 and b["params"] == sft["bytes_per_device"]["params"]
    # the old policy's log-probs, one fp32 per target of the device's rows
    assert extra["rollout_logps"] == 16 * 64 // 8 * 4
    kl = plan(cfg, preset, PlanOptions(**opts, objective="grpo", kl_beta=0.04), 1)
    assert kl["bytes_per_device"]["reference"] == kl["bytes_per_device"]["params"]
    assert kl["detail"]["objective"]["rollout_logps"] == 2 * extra["rollout_logps"]   # + ref_logp
    lora = plan(cfg, preset, PlanOptions(**opts, objective="grpo", kl_beta=0.04, lora_rank=4), 1)
    assert lora["bytes_per_device"]["reference"] == 0                                   # adapters off
    dpo = plan(cfg, preset, PlanOptions(**opts, objective="dpo"), 1)
    assert dpo["bytes_per_device"]["total"] == sft["bytes_per_device"]["total"] + 16 * 64 // 8 * 4
    # and on the command line: K3 GRPO on v5p-1024, rollouts of every completion of the step
    out = run_json(capsys, "configs/k3.yaml", "--mesh", "v5p-1024", "--objective", "grpo", "--batch", "128")
    assert out["objective"] == "grpo" and out["detail"]["objective"]["rollout_caches"] > 0
    assert main(["plan", "k3", "--mesh", "v5p-1024", "--mode", "infer", "--objective", "dpo"]) == 2
    assert "--objective 'dpo': plans a train step: use --mode train" in capsys.readouterr().err


# Full-K3 train steps compiled for v5p:8x8x8 with the code of the date (docs/performance.md,
# "Full K3: XLA's figures beside the planner's"): flags, XLA's total GiB a chip
XLA_COMPILED = [
    (("--batch", "128"), 84.3),                                                   # 2026-12-03
    (("--batch", "256", "--ep-buffer-mib", "256"), 90.3),                         # 2026-12-06
    (("--batch", "2048", "--grad-accum", "8", "--expert-format", "mxfp4", "--lora-rank", "16",
      "--ep-buffer-mib", "1024"), 56.7),                                          # 2026-12-06
    (("--batch", "2048", "--grad-accum", "16", "--optimizer-offload", "--ep-buffer-mib", "1024"), 84.49),  # 2026-12-07
    (("--batch", "2048", "--grad-accum", "16", "--optimizer-offload", "--ep-buffer-mib", "1024",
      "--ep-capacity", "1.25"), 81.01),                                           # 2026-12-07
    (("--batch", "2048", "--grad-accum", "4", "--expert-format", "mxfp4", "--lora-rank", "16",
      "--ep-buffer-mib", "1024"), 92.05),                                         # 2026-12-07
    (("--batch", "128", "--expert-format", "mxfp4", "--lora-rank", "16", "--ep-buffer-mib", "1024"), 30.87),  # 2026-12-07
    (("--batch", "2048", "--grad-accum", "4", "--expert-format", "mxfp4", "--lora-rank", "16",
      "--ep-buffer-mib", "256"), 69.51),                                          # 2026-12-07
    # the short command: the planner chooses 4 x 512 and 512 MiB chunks, as it compiled
    (("--batch", "2048", "--expert-format", "mxfp4", "--lora-rank", "16"), 71.67),  # 2026-12-07
]


@pytest.mark.parametrize("flags,xla_gib", XLA_COMPILED)
def test_the_planner_is_within_ten_percent_of_xla_on_the_compiled_k3_steps(capsys, flags, xla_gib):
    """The planner against XLA's own memory analysis of the full step (an independent
    figure: `k3jax compile` in the [tpu] venv), on every current row of the table."""
    off = () if "--optimizer-offload" in flags else ("--no-optimizer-offload",)
    out = run_json(capsys, "configs/k3.yaml", "--mesh", "v5p-1024", "--seq", "4096", *flags, *off)
    assert out["bytes_per_device"]["total"] / GIB == pytest.approx(xla_gib, rel=0.10)
    if flags == XLA_COMPILED[-1][0]:     # the short LoRA command: the choice compiled is the planner's
        assert (out["grad_accum"], out["ep_buffer_mib"], out["optimizer_offload"]) == (4, 512.0, False)


def test_qat_over_lora_on_tpu_adds_nothing_as_xla_compiled_it(capsys):
    """K3's LoRA r16 step over MXFP4 at 128 x 4096 on v5p-1024, compiled by XLA:TPU side by
    side (`k3jax compile configs/k3.yaml --mesh v5p-1024 --topology v5p:8x8x8 --mode train
    --optimizer muon --expert-format mxfp4 --lora-rank 16 --batch 128 --seq 4096 [--qat]`,
    2026-12-08): 30.87 GiB a chip without QAT, 29.23 with. XLA fuses each bf16(W + s·A·B)
    merge into its projection's operand, so the plan gains no `qat` bytes there; it had
    counted one layer's merged dense kernels in fp32 (4.4 GiB, 26 % over XLA's total)."""
    flags = ("--mesh", "v5p-1024", "--seq", "4096", "--batch", "128", "--expert-format", "mxfp4",
             "--lora-rank", "16", "--ep-buffer-mib", "1024", "--no-optimizer-offload")
    plain = run_json(capsys, "configs/k3.yaml", *flags)
    qat = run_json(capsys, "configs/k3.yaml", *flags, "--qat")
    assert qat["detail"]["activations"]["qat"] == 0
    assert qat["bytes_per_device"] == plain["bytes_per_device"]
    assert qat["bytes_per_device"]["total"] / GIB >= 29.23        # not under XLA's own figure


def test_qat_adds_one_layers_experts_as_the_bytes_the_forward_makes():
    """`--qat` over widened experts: the train step quantizes one MoE layer's local experts
    to MXFP4 bytes (ops.qat.requantized); the planner's term is those arrays' size on a
    device (shapes from the model's own params, split over the expert axis)."""
    import jax
    import numpy as np

    from k3jax.model import param_shapes
    from k3jax.ops.qat import requantized
    cfg, preset = load("toy"), load_preset("expert8")
    opt = PlanOptions(batch=8, seq=64)
    base = plan(cfg, preset, opt, 1)["detail"]["activations"]
    qat = plan(cfg, preset, dataclasses.replace(opt, qat=True), 1)["detail"]["activations"]
    assert "qat" not in base and {k: v for k, v in qat.items() if k != "qat"} == base
    stacks = [leaf for path, leaf in jax.tree_util.tree_leaves_with_path(param_shapes(cfg))
              if any(getattr(k, "key", None) in ("w1", "w2", "w3") for k in path)]
    one_layer = [s.shape[-3:] for s in stacks[:3]]      # [E, in, out] of a layer's w1, w2, w3
    local = [jax.ShapeDtypeStruct((e // 8, *rest), np.float32) for e, *rest in one_layer]
    made = sum(x.size * x.dtype.itemsize for w in local for x in jax.eval_shape(lambda w: requantized(w, None, 0.0), w))
    assert qat["qat"] == made
