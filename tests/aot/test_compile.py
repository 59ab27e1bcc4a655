"""k3jax compile's pieces: loop-aware HLO totals, reduced depths and their extrapolation,
the decode-time gather dispatch, and (in the [tpu] environment) a toy compile for a TPU
topology through the command itself."""
import dataclasses
import functools
import importlib.util
import json
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from k3jax.aot import depth, hlo, report
from k3jax.aot.programs import serve_programs
from k3jax.config import load, load_k3
from k3jax.plan import PlanOptions
from tests.helpers import ROOT

# A hand-written optimized-HLO module: a 5-trip loop holding a dot [8,16]x[16,32] inside a
# fusion and an all-gather over groups of 4; a convolution-form matmul outside the loop.
HANDWRITTEN = """HloModule m, entry_computation_layout={()->f32[8,32]}

%fused_dot (p0: f32[8,16], p1: f32[16,32]) -> f32[8,32] {
  %p0 = f32[8,16]{1,0} parameter(0)
  %p1 = f32[16,32]{1,0} parameter(1)
  ROOT %dot.1 = f32[8,32]{1,0} dot(%p0, %p1), lhs_contracting_dims={1}, rhs_contracting_dims={0}
}

%body (param: (s32[], f32[8,16], f32[16,32], bf16[2,32])) -> (s32[], f32[8,16], f32[16,32], bf16[2,32]) {
  %param = (s32[], f32[8,16]{1,0}, f32[16,32]{1,0}, bf16[2,32]{1,0}) parameter(0)
  %i = s32[] get-tuple-element(%param), index=0
  %x = f32[8,16]{1,0} get-tuple-element(%param), index=1
  %w = f32[16,32]{1,0} get-tuple-element(%param), index=2
  %s = bf16[2,32]{1,0} get-tuple-element(%param), index=3
  %f = f32[8,32]{1,0} fusion(%x, %w), kind=kOutput, calls=%fused_dot
  %ag = bf16[8,32]{1,0} all-gather(%s), channel_id=1, replica_groups=[2,4]<=[8], dimensions={0}
  %one = s32[] constant(1)
  %next = s32[] add(%i, %one)
  ROOT %t = (s32[], f32[8,16]{1,0}, f32[16,32]{1,0}, bf16[2,32]{1,0}) tuple(%next, %x, %w, %s)
}

%cond (param.1: (s32[], f32[8,16], f32[16,32], bf16[2,32])) -> pred[] {
  %param.1 = (s32[], f32[8,16]{1,0}, f32[16,32]{1,0}, bf16[2,32]{1,0}) parameter(0)
  %c = s32[] get-tuple-element(%param.1), index=0
  %n = s32[] constant(5)
  ROOT %lt = pred[] compare(%c, %n), direction=LT
}

ENTRY %main () -> f32[8,32] {
  %zero = s32[] constant(0)
  %x0 = f32[8,16]{1,0} constant({...})
  %w0 = f32[16,32]{1,0} constant({...})
  %s0 = bf16[2,32]{1,0} constant({...})
  %init = (s32[], f32[8,16]{1,0}, f32[16,32]{1,0}, bf16[2,32]{1,0}) tuple(%zero, %x0, %w0, %s0)
  %loop = (s32[], f32[8,16]{1,0}, f32[16,32]{1,0}, bf16[2,32]{1,0}) while(%init), condition=%cond, body=%body
  %a = f32[8,16]{1,0} get-tuple-element(%loop), index=1
  %b = f32[16,32]{1,0} get-tuple-element(%loop), index=2
  ROOT %conv = f32[8,32]{1,0} convolution(%a, %b), dim_labels=bf_io->bf
}
"""


def test_hlo_totals_count_every_loop_iteration():
    t = hlo.analyse(HANDWRITTEN)
    dot = 2 * 8 * 16 * 32
    assert t.loops == [("loop", 5)] and not t.unknown_loops
    assert t.flops == 5 * dot + dot                     # five iterations, then the convolution
    assert t.flops_once == dot + dot                    # XLA's cost analysis: the body once
    assert t.collectives == {"all-gather": 5 * (2 * 32 * 2) * 3}   # 5 × shard bytes × (g − 1)
    # per iteration: the fusion reads x, w and writes its result; the all-gather reads its
    # shard and writes the gathered array; the counter's add; the condition runs 6 times
    matmul_io = (8 * 16 + 16 * 32 + 8 * 32) * 4
    body = matmul_io + (2 * 32 + 8 * 32) * 2 + 3 * 4
    assert t.hbm_bytes == 5 * body + 6 * (1 + 2 * 4) + matmul_io


# A decode step's chosen expert copied out of a [4, 64, 32] stack into a [2, 64, 32] buffer
# in place (a fusion whose root is a dynamic-update-slice of its parameter 0), and a fusion
# that reads one layer of a stacked cache through a nested fusion's dynamic slice.
IN_PLACE = """HloModule m, entry_computation_layout={()->f32[2]}

%copy_one (b: bf16[2,64,32], w: bf16[4,64,32], i: s32[]) -> bf16[2,64,32] {
  %b = bf16[2,64,32]{2,1,0} parameter(0)
  %w = bf16[4,64,32]{2,1,0} parameter(1)
  %i = s32[] parameter(2)
  %z = s32[] constant(0)
  %e = bf16[1,64,32]{2,1,0} dynamic-slice(%w, %i, %z, %z), dynamic_slice_sizes={1,64,32}
  %one = s32[] constant(1)
  ROOT %u = bf16[2,64,32]{2,1,0} dynamic-update-slice(%b, %e, %one, %z, %z)
}

%layer (c: f32[3,8,16], j: s32[]) -> f32[8,16] {
  %c = f32[3,8,16]{2,1,0} parameter(0)
  %j = s32[] parameter(1)
  %z.1 = s32[] constant(0)
  %d = f32[1,8,16]{2,1,0} dynamic-slice(%c, %j, %z.1, %z.1), dynamic_slice_sizes={1,8,16}
  ROOT %r = f32[8,16]{1,0} bitcast(%d)
}

%score (c.1: f32[3,8,16], j.1: s32[]) -> f32[2] {
  %c.1 = f32[3,8,16]{2,1,0} parameter(0)
  %j.1 = s32[] parameter(1)
  %l = f32[8,16]{1,0} fusion(%c.1, %j.1), kind=kLoop, calls=%layer
  %zero = f32[] constant(0)
  %s = f32[8]{0} reduce(%l, %zero), dimensions={1}, to_apply=%add
  ROOT %h = f32[2]{0} slice(%s), slice={[0:2]}
}

%add (a: f32[], b.1: f32[]) -> f32[] {
  %a = f32[] parameter(0)
  %b.1 = f32[] parameter(1)
  ROOT %sum = f32[] add(%a, %b.1)
}

ENTRY %main () -> f32[2] {
  %buf = bf16[2,64,32]{2,1,0} constant({...})
  %stack = bf16[4,64,32]{2,1,0} constant({...})
  %k = s32[] constant(3)
  %out = bf16[2,64,32]{2,1,0} fusion(%buf, %stack, %k), kind=kLoop, calls=%copy_one
  %cache = f32[3,8,16]{2,1,0} constant({...})
  ROOT %sc = f32[2]{0} fusion(%cache, %k), kind=kLoop, calls=%score
}
"""


def test_in_place_updates_and_nested_slices_count_what_they_touch():
    comps, entry = hlo.parse(IN_PLACE)
    shapes = comps[entry].shapes()
    by = {i.name: hlo.instr_bytes(i, shapes, comps=comps) for i in comps[entry].instrs}
    expert = 64 * 32 * 2
    assert by["out"] == expert + expert + 4          # one expert read, one written; the index
    assert by["sc"] == 8 * 16 * 4 + 4 + 2 * 4        # one layer of the cache, the index, the result


def test_hlo_replica_group_spellings():
    assert hlo.group_size("replica_groups={{0,1,2,3},{4,5,6,7}}, dimensions={0}") == 4
    assert hlo.group_size("replica_groups=[64,8]<=[512], dimensions={0}") == 8
    assert hlo.group_size("replica_groups=mesh['axis_0'=4,'axis_1'=1,'axis_2'=2], "
                          "device_ids=([2,4]T(1,0)) {'axis_0','axis_2'}, dimensions={1}") == 8


def test_a_compiled_scan_counts_its_trip_count_and_xla_does_not():
    n, M, K = 3, 16, 32

    def f(x, w):
        return jax.lax.scan(lambda c, wi: (jnp.tanh(c @ wi), None), x, w)[0]
    c = jax.jit(f).lower(jax.ShapeDtypeStruct((M, K), jnp.float32),
                         jax.ShapeDtypeStruct((n, K, K), jnp.float32)).compile()
    t = hlo.analyse(c.as_text())
    xla = c.cost_analysis()
    xla = xla[0] if isinstance(xla, (list, tuple)) else xla
    assert t.flops == n * 2 * M * K * K
    assert xla["flops"] < 1.5 * 2 * M * K * K           # why hlo.py exists: one iteration


def _deep_toy(groups: int):
    """The toy K3 with its [KDA, KDA, KDA, MLA] group repeated `groups` times."""
    k3 = load_k3("toy")
    cfg = k3.text
    plan_kinds = list(zip(cfg.layer_kinds, cfg.ffn_kinds))
    head, group, tail = plan_kinds[:4], plan_kinds[4:8], plan_kinds[12:]
    return dataclasses.replace(k3, text=_with_kinds(cfg, head + group * groups + tail))


def _with_kinds(cfg, kinds):
    return cfg.replace(num_hidden_layers=len(kinds), hf_extra={}, hf_keys=(),
                       kda_layers=tuple(i + 1 for i, (a, _) in enumerate(kinds) if a == "kda"),
                       full_attn_layers=tuple(i + 1 for i, (a, _) in enumerate(kinds) if a == "mla"))


def _kda_toy(groups: int):
    """The toy's widths with no head or tail: `groups` KDA+MoE layers, each its own scanned
    group, the smallest model whose depth is all scanned group (cheap compiles)."""
    k3 = load_k3("toy")
    cfg = k3.text.replace(first_k_dense_replace=0, attn_res_block_size=2)
    return dataclasses.replace(k3, text=_with_kinds(cfg, [("kda", "moe")] * groups))


def test_reduced_depth_keeps_the_plan_and_the_attn_res_stack():
    from k3jax.layout import layer_plan
    full = _deep_toy(4).text
    r = depth.reduced(full, 2)
    assert depth.group_count(full) == 4 and r.num_hidden_layers == full.num_hidden_layers - 8
    assert layer_plan(r).group == layer_plan(full).group and layer_plan(r).head == layer_plan(full).head
    assert r.max_attn_res_blocks == full.max_attn_res_blocks == 6      # not ceil(13 / 4) = 4
    with pytest.raises(ValueError, match="n_groups must lie in 2..4"):
        depth.reduced(full, 5)


@pytest.mark.slow
def test_extrapolating_two_depths_predicts_a_third_within_2_percent():
    """The compiled step's memory terms, FLOPs and HBM bytes are linear in the group count:
    extrapolating from 2 and 3 groups predicts what compiling 4 groups gives."""
    full = _kda_toy(4)
    opt = PlanOptions(mode="infer", batch=2, seq=32, prefill_chunk=32, param_dtype="float32")
    devices = jax.devices()[:1]

    def figures(k3):
        # the recurrent KDA and the every-expert MoE: the smallest programs (compile time)
        prog = serve_programs(k3, "fsdp", devices, opt, runtime={"kda_impl": "recurrent", "moe_dispatch": "dense"})[0]
        fig, _ = report.measure(prog, log=lambda *_: None)
        return {"flops": fig["flops"], "hbm_bytes": fig["hbm_bytes"],
                **{k: fig["memory"][k] for k in ("arguments", "outputs", "temporaries", "total")}}

    f2, f3 = (figures(dataclasses.replace(full, text=depth.reduced(full.text, n))) for n in (2, 3))
    predicted, compiled = depth.extrapolate(2, f2, 3, f3, 4), figures(full)
    for k, v in compiled.items():
        assert predicted[k] == pytest.approx(v, rel=0.02), k
    assert compiled["flops"] > f3["flops"] > f2["flops"]    # the depth is really in the figures


@pytest.mark.slow
@pytest.mark.parametrize("preset,n,fmt,lora,one_by_one", [("expert8", 2, "bf16", "per_expert", None),
                                                         ("fsdp2_expert2_tensor2", 3, "mxfp4", "shared_a", None),
                                                         ("expert_hidden8", 2, "bf16", "per_expert", None),
                                                         ("expert_hidden8", 3, "mxfp4", "shared_a", None),
                                                         ("expert_hidden8", 3, "bf16", "per_expert", 1),
                                                         ("fsdp2_expert2_tensor2", 2, "bf16", "shared_a", 1)])
def test_gather_dispatch_matches_dense(monkeypatch, preset, n, fmt, lora, one_by_one):
    """The decode dispatch against every-expert einsum (moe 'dense', the oracle, which
    widens MXFP4 stacks whole and adds A·B to every expert), with fewer pairs than experts
    (so experts are really left out), MXFP4-resident experts and both adapter forms, on
    meshes splitting the experts over `expert` and their hidden over `tensor`, and on one
    splitting no experts but each one's hidden over all 8 devices (expert_hidden8; MXFP4's
    w2 scale groups there split only 2 ways). With fewer experts taken one by one than the
    pairs name (`one_by_one`; K3 at 32 sequences), every local expert runs once with the
    routing folded into w2."""
    from k3jax.ops import moe_gather
    if one_by_one is not None:
        monkeypatch.setattr(moe_gather, "_SLICED_MAX", one_by_one)
    from k3jax.mesh import load_mesh, use_mesh
    from k3jax.config import LoraSpec
    from k3jax.layers.mlp import glu_activation
    from k3jax.ops.moe_dispatch import DISPATCH, experts_dense
    from k3jax.ops.mxfp4 import MXFP4, quantize_mxfp4_jax
    cfg = load("toy")
    if lora:
        cfg = cfg.with_runtime(lora=LoraSpec(rank=4, alpha=8.0, targets=frozenset(
            f"block_sparse_moe/{r}" for r in ("w1", "w2", "w3")), expert_rank=2, expert_mode=lora))
    rng = np.random.default_rng(n)
    E, H, F, k, r = 8, 64, 64, 2, 2
    f32 = lambda *shape: jnp.asarray(rng.standard_normal(shape) * 0.2, jnp.float32)  # noqa: E731
    z, w = f32(n, H), jnp.asarray(rng.random((n, k)), jnp.float32)
    idx = jnp.asarray(np.stack([rng.choice(E, k, replace=False) for _ in range(n)]), jnp.int32)
    weights = {"w1": f32(E, H, F), "w3": f32(E, H, F), "w2": f32(E, F, H)}
    if fmt == "mxfp4":   # the checkpoint's [E, out, in] orientation, packed
        weights = {k_: MXFP4(*quantize_mxfp4_jax(jnp.swapaxes(v, -1, -2))) for k_, v in weights.items()}
    adapters = {}
    if lora:
        for role, (i, o) in {"w1": (H, F), "w3": (H, F), "w2": (F, H)}.items():
            adapters[role] = (f32(i, r) if lora == "shared_a" else f32(E, i, r), f32(E, r, o))
    act = functools.partial(glu_activation, cfg)
    ref = np.asarray(experts_dense(cfg, act, z, idx, w, weights, adapters))
    fn = jax.jit(lambda *a: DISPATCH["gather"](cfg, act, *a))
    if preset is None:
        got = fn(z, idx, w, weights, adapters)
    else:
        mesh, rules = load_mesh(preset)
        with use_mesh(mesh, rules):
            got = fn(z, idx, w, weights, adapters)
    np.testing.assert_allclose(np.asarray(got), ref, rtol=1e-5, atol=1e-5)
    assert np.abs(ref).max() > 0.1


def _tpu_python():
    """A Python with libtpu: K3JAX_TPU_PYTHON, or this one if it has libtpu."""
    exe = os.environ.get("K3JAX_TPU_PYTHON")
    if exe:
        return exe
    return sys.executable if importlib.util.find_spec("libtpu") else None


@pytest.mark.skipif(_tpu_python() is None, reason="no [tpu] environment: set K3JAX_TPU_PYTHON to a Python with "
                                                   "libtpu (pip install -e '.[tpu]' in a separate venv)")
def test_toy_decode_compiles_for_a_v5p_topology():
    """`k3jax compile` end to end in the [tpu] environment: the toy's decode step on 8 v5p
    chips; XLA's total is the sum of its terms and the planner's is reported beside it."""
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_PLATFORMS")}
    env["PYTHONPATH"] = str(ROOT)
    r = subprocess.run([_tpu_python(), "-m", "k3jax.cli", "compile", "toy", "--mesh", "data2_fsdp2_expert2",
                        "--topology", "v5p:2x2x2", "--mode", "decode", "--batch", "8", "--seq", "64", "--json"],
                       capture_output=True, text=True, env=env, timeout=1800)
    assert r.returncode == 0, r.stderr[-3000:]
    out = json.loads(r.stdout.strip().splitlines()[-1])
    m = out["memory"]
    assert out["fits"] and out["layers_compiled"] == [13] and not out["extrapolated"]
    assert m["total"] == m["arguments"] + m["outputs"] - m["aliases"] + m["temporaries"] + m["generated_code"]
    assert out["plan_total_bytes"] > 0 and out["flops_per_step"] > 0 and out["estimated_step_s"] > 0


@pytest.mark.skipif(_tpu_python() is None, reason="no [tpu] environment: set K3JAX_TPU_PYTHON to a Python with "
                                                   "libtpu (pip install -e '.[tpu]' in a separate venv)")
def test_compile_refuses_what_train_and_plan_refuse():
    """key=value overrides go through train's schema and the numbers through the planner's
    checks, before anything compiles: one line, exit 2 (they used to compile without them)."""
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_PLATFORMS")}
    env["PYTHONPATH"] = str(ROOT)
    for extra, said in ((["foo=1"], "train.foo: unknown key"), (["steps=abc"], "train.steps: expected an integer"),
                        (["lora.rnk=16"], "train.lora.rnk: unknown key"), (["--batch", "0"], "--batch 0"),
                        (["--batch", "3"], "batch 3 does not split over the 4 batch shards")):
        r = subprocess.run([_tpu_python(), "-m", "k3jax.cli", "compile", "toy", "--mesh", "fsdp",
                            "--topology", "v5p:2x2x1", "--mode", "train", *extra],
                           capture_output=True, text=True, env=env, timeout=600)
        assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1 and said in r.stderr, (extra, r.stderr)


def test_topology_and_environment_errors_name_the_fix():
    """A malformed --topology, or compile outside the [tpu] environment, is one line naming
    the fix (exit 2), before anything loads; in the [tpu] environment a topology libtpu cannot
    lay out says what a valid one looks like."""
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_PLATFORMS")}
    env["PYTHONPATH"] = str(ROOT)
    cases = [(sys.executable, "banana", "expected CHIP:AxBxC such as v5p:8x8x8")]
    if importlib.util.find_spec("libtpu") is None:
        cases.append((sys.executable, "v5p:2x2x1", "needs the TPU compiler (libtpu)"))
    if _tpu_python() is not None:
        cases += [(_tpu_python(), "v5p:9x9x9", "each dimension must be a multiple of a host's chips"),
                  (_tpu_python(), "x9:2x2x1", "name a TPU generation")]
    for python, topology, said in cases:
        r = subprocess.run([python, "-m", "k3jax.cli", "compile", "toy", "--mesh", "fsdp", "--topology", topology],
                           capture_output=True, text=True, env=env, timeout=300)
        assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1 and said in r.stderr, r.stderr


def test_costliest_instructions_hold_every_flop_once_and_rank_by_their_estimate():
    """Every matmul FLOP lands on exactly one top-level instruction (a fusion carries its fused
    dots, a loop body's instructions each iteration), and `costliest` ranks them by the step's
    own per-instruction model, shares summing to at most 1."""
    t = hlo.analyse(HANDWRITTEN)
    assert sum(v[1] for v in t.instructions.values()) == t.flops
    from k3jax.aot.chips import chip_for
    chip = dataclasses.replace(chip_for("v5p"), hbm_bandwidth=1e30, ici_bandwidth=1e30)   # FLOPs alone decide
    top = report.costliest(t.instructions, chip, n=2)
    dot = 2 * 8 * 16 * 32
    assert [c["flops"] for c in top] == [5 * dot, dot]      # the loop's matmul (5 runs), then the conv
    assert top[0]["share"] == pytest.approx(5 / 6) and top[1]["share"] == pytest.approx(1 / 6)

    # a CPU-compiled program: one large and one small product
    def f(a, b, c, d):
        return jnp.sum(a @ b) + jnp.sum(c @ d)
    x = [jnp.ones(s, jnp.float32) for s in ((256, 256), (256, 256), (8, 8), (8, 8))]
    t = hlo.analyse(jax.jit(f).lower(*x).compile().as_text())
    assert sum(v[1] for v in t.instructions.values()) == t.flops == 2 * 256 ** 3 + 2 * 8 ** 3
    first = report.costliest(t.instructions, chip)[0]
    assert first["flops"] == 2 * 256 ** 3 and first["share"] > 0.99


def test_by_scope_sums_the_instructions_by_where_they_come_from():
    """`by_scope` groups a program's instructions by their op_name's scopes, forward apart
    from backward (the transpose), and every FLOP lands in exactly one group: the forward
    product of a [64, 256] @ [256, 256] in scope 'big', its two backward products, a small
    product in scope 'small'."""
    from k3jax.aot.chips import chip_for
    chip = dataclasses.replace(chip_for("v5p"), hbm_bandwidth=1e30, ici_bandwidth=1e30)

    def loss(w, x, v):
        with jax.named_scope("big"):
            y = jnp.sum((x @ w) ** 2)
        with jax.named_scope("small"):
            return y + jnp.sum(v @ v)
    x = [jnp.full(s, 0.5, jnp.float32) for s in ((256, 256), (64, 256), (8, 8))]
    t = hlo.analyse(jax.jit(jax.value_and_grad(loss)).lower(*x).compile().as_text())
    groups = {g["scope"]: g for g in report.by_scope(t.instructions, chip, n=100)}
    assert sum(g["flops"] for g in groups.values()) == t.flops
    assert sum(g["share"] for g in groups.values()) == pytest.approx(1.0)
    assert groups["backward: big"]["flops"] == 2 * 64 * 256 * 256      # dW only: x is not differentiated
    assert groups["forward: big"]["flops"] == 2 * 64 * 256 * 256
    assert groups["forward: small"]["flops"] == 2 * 8 ** 3
    assert not any(k.startswith("backward") and "small" in k for k in groups)
