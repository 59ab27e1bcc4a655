"""The programs `k3jax compile` lowers: the CLI's own jitted steps, with abstract inputs.

Nothing here re-states a step. Training is `train.step.make_train_step` wrapped by
`train.loop.sharded_train_step` (the shardings pinned exactly as `k3jax train --mesh` pins
them, the optimizer state's read off a compiled update); serving is `infer.generate`'s
`prefill_step` (a fresh prefill, which creates the caches) and `extend_step` (a chunk of a
long prompt, or one decode token, on top of the caches). Only the inputs are new: params,
optimizer state, caches and batches as ShapeDtypeStructs carrying the shardings the real
run gives them, on a mesh preset laid over whatever devices are passed (a TPU topology's
on a CPU host, or CPU devices standing in for GPUs).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec as P

from k3jax.mesh import load_mesh, load_preset, logical_shards, preset_for, use_mesh
from k3jax.model import param_shardings
from k3jax.config import ConfigError, K3Config
from k3jax.plan import PlanOptions

MODES = ("train", "prefill", "decode")


@dataclass
class Program:
    """One jitted function and the abstract arguments it is lowered with."""
    mode: str
    fn: Any
    args: tuple
    mesh: Any
    rules: tuple
    cfg: Any                  # the ModelConfig the step runs
    tokens: int               # global tokens the call processes (decode: one per sequence)
    batch: int
    seq: int                  # train: sequence length; serving: the caches' max_len
    new_tokens: int           # tokens per sequence in this call
    note: str = ""
    tc: dict | None = None    # the resolved train config (train mode)

    def lower(self):
        with use_mesh(self.mesh, self.rules):
            return self.fn.lower(*self.args)


def _sds(x, s):
    return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s)


def abstract_params(cfg, mesh, rules):
    """The params (LoRA adapters under 'lora' when the config has them) as
    ShapeDtypeStructs with `param_shardings`' shardings."""
    from flax import linen as nn

    from k3jax.model import abstract_variables
    boxed = abstract_variables(cfg)
    plain = jax.tree.map(lambda x: x.value, boxed, is_leaf=lambda x: isinstance(x, nn.Partitioned))
    return jax.tree.map(_sds, plain, param_shardings(cfg, mesh, rules))


def default_batch(preset, opt: PlanOptions, n_devices: int) -> int:
    """The planner's default: one sequence per batch shard."""
    sizes = preset.shape(n_devices)
    return opt.batch or logical_shards(preset.rules, sizes, ("batch",))


def check_layout(preset, n_devices: int, batch: int, seq: int):
    """The batch [batch, seq] must split evenly over the axes the rules give batch and
    length (a sharded input cannot be padded); say which preset settings would."""
    sizes = preset.shape(n_devices)
    for what, n, logical in (("batch", batch, "batch"), ("seq", seq, "length")):
        ways = logical_shards(preset.rules, sizes, (logical,))
        if n % ways:
            hint = (" (or a preset that splits each sequence over a context axis, e.g. v5p-1024-cp4)"
                    if what == "batch" else "")
            raise ConfigError(f"--{what} {n}: {preset.name} splits {logical} {ways} ways, which {n} does not "
                              f"divide: give a multiple of {ways}{hint}")


def _runtime(opt: PlanOptions) -> dict:
    """Runtime options a PlanOptions implies: params (and so compute) in its dtype, routed
    experts in its format."""
    return {"param_dtype": opt.param_dtype, "dtype": opt.param_dtype, "remat": opt.remat,
            "ep_capacity_factor": opt.ep_capacity_factor, "expert_format": opt.expert_format}


def _lora_section(opt: PlanOptions) -> dict:
    """The train config's `lora:` section a PlanOptions implies (as `k3jax plan` reads it)."""
    if not opt.lora_rank:
        return {}
    return {"lora": {"rank": opt.lora_rank, "expert_rank": opt.lora_expert_rank,
                     "expert_mode": opt.lora_expert_mode, "optimizer": opt.lora_optimizer,
                     "targets": list(opt.lora_targets) if opt.lora_targets is not None else None}}


def _objective_section(opt: PlanOptions, batch: int) -> dict:
    """The train config's objective keys a PlanOptions implies: DPO and GRPO read chat rows;
    GRPO's groups are the largest that divide the step's completions, up to train's default
    group_size; its KL term is on with opt.kl_beta (the batch then carries the reference's
    log-probs)."""
    from k3jax.train.config import DEFAULTS
    if opt.objective == "sft":
        return {}
    out = {"objective": opt.objective, "data": {"format": "chat"}}
    if opt.objective == "grpo":
        g = DEFAULTS["grpo"]
        groups = [n for n in range(g["group_size"], 1, -1) if batch % n == 0]
        if not groups:
            raise ConfigError(f"--batch {batch}: GRPO samples groups of >= 2 completions per prompt; give an even batch")
        # the update's rows are [B, seq] whatever the completions' length; max_tokens only has
        # to leave a prompt room, as train checks
        out["grpo"] = {"group_size": groups[0], "kl_beta": opt.kl_beta,
                       "max_tokens": min(g["max_tokens"], opt.seq // 2)}
    return out


def train_program(k3: K3Config, preset_name: str, devices, opt: PlanOptions, overrides: dict | None = None,
                  physical: bool = True) -> Program:
    """`k3jax train --mesh` 's step for `opt.batch` × `opt.seq` tokens, as `opt.grad_accum`
    microbatches (None: one).

    `overrides`: a nested `train:` section merged last (like `k3jax train key=value`)."""
    from k3jax.train import config as tconf, loop, muon, step as tstep
    if opt.optimizer != "muon":
        raise ConfigError(f"--optimizer {opt.optimizer}: `k3jax train` runs Per-Head Muon (AdamW on "
                          f"embeddings, vectors and lm_head); compile it with --optimizer muon")
    accum = opt.grad_accum or 1
    micro = opt.batch // accum if opt.batch else None
    preset = preset_for(preset_name, "train", micro, len(devices))   # as `k3jax train --mesh` picks it
    mesh, rules = load_mesh(preset, devices, physical=physical)
    micro = micro or default_batch(preset, opt, len(devices))
    check_layout(preset, len(devices), micro, opt.seq)
    batch = micro * accum
    section = {"data": {"seq_len": opt.seq, "batch_size": micro, "grad_accum": accum}, "runtime": _runtime(opt),
               **_lora_section(opt)}
    section = _merge(section, _objective_section(opt, batch=micro * accum))
    if opt.freeze:
        section["optimizer"] = {"freeze": list(opt.freeze)}
    if opt.qat:
        section["qat"] = True
    tc = tconf.resolve(_merge(k3.train, section), overrides)
    cfg = loop.run_model_config(k3, tc)
    with use_mesh(mesh, rules):
        params = abstract_params(cfg, mesh, rules)
        tx, groups = muon.build_optimizer(cfg, params, tc["optimizer"], tc["steps"],
                                          tc["lora"] if cfg.runtime.lora is not None else None)
        train_step = tstep.make_train_step(cfg, tc, tx, groups)
        from k3jax.train import objectives    # the step's batch as the loop lays it out (GRPO's and DPO's extras)
        spec = objectives.batch_spec(cfg, tc)
        rows = loop.accum_batch_shardings((mesh, rules), spec)
        opt_sh = loop.optimizer_shardings(tx, params, groups)
        state_sh, step = loop.sharded_train_step((mesh, rules), params, tx, groups, train_step, rows, opt_sh,
                                                 offload=cfg.runtime.optimizer_offload)
        opt_sh = state_sh.opt_state
        opt_state = jax.tree.map(_sds, jax.eval_shape(lambda p: tstep.opt_init(tx, p, groups), params), opt_sh)
    state = tstep.TrainState(step=jax.ShapeDtypeStruct((), jnp.int32, sharding=state_sh.step),
                             params=params, opt_state=opt_state)
    batch_in = {k: jax.ShapeDtypeStruct(shape, dt, sharding=rows[k]) for k, (shape, dt) in spec.items()}
    return Program("train", step, (state, batch_in), mesh, rules, cfg, tokens=batch * opt.seq, batch=batch,
                   seq=opt.seq, new_tokens=opt.seq, tc=tc)


def rollout_programs(train: Program) -> tuple[Program, Program]:
    """GRPO's rollout, the engine step `k3jax train` runs between updates
    (infer.slots.step): (a prompt chunk, a decode token) for every one of grpo.rollout_slots
    slots at once, over caches of data.seq_len tokens laid out as the run lays them
    (caches.cache_shardings), with the update's params as they are between steps."""
    from k3jax.infer import slots as S
    from k3jax.infer.caches import cache_shardings, init_cache
    from k3jax.train.rollouts import PROMPT_CHUNK
    tc, mesh, cfg = train.tc, train.mesh, train.cfg
    d = tc["data"]
    slots = min(tc["grpo"]["rollout_slots"], d["batch_size"] * d["grad_accum"])
    max_len = d["seq_len"]
    shapes = jax.eval_shape(lambda: init_cache(cfg, slots, max_len))
    cache = jax.tree.map(_sds, shapes, cache_shardings(shapes, mesh, train.rules))
    rep = NamedSharding(mesh, P())
    vec = lambda dt: jax.ShapeDtypeStruct((slots,), dt, sharding=rep)  # noqa: E731  (per-slot settings, host-made)
    sampling = (vec(jnp.uint32), vec(jnp.int32), vec(jnp.float32), vec(jnp.int32), vec(jnp.float32))

    def one(mode: str, width: int) -> Program:
        ids = jax.ShapeDtypeStruct((slots, width), jnp.int32, sharding=rep)
        return Program(mode, S.step, (cfg, train.args[0].params, cache, ids, vec(jnp.int32), *sampling), mesh,
                       train.rules, cfg, tokens=slots * width, batch=slots, seq=max_len, new_tokens=width, tc=tc)
    return one("rollout_prefill", PROMPT_CHUNK), one("rollout_decode", 1)


def device_bytes(tree) -> int:
    """Per-device bytes of abstract arrays in device memory (those placed in host memory,
    e.g. an offloaded optimizer state, count nothing)."""
    import math
    total = 0
    for x in jax.tree.leaves(tree):
        if getattr(x.sharding, "memory_kind", None) == "pinned_host":
            continue
        total += math.prod(x.sharding.shard_shape(x.shape)) * x.dtype.itemsize
    return total


def _merge(base: dict, over: dict) -> dict:
    out = dict(base or {})
    for k, v in over.items():
        out[k] = _merge(out.get(k) or {}, v) if isinstance(v, dict) else v
    return out


def serve_config(k3: K3Config, opt: PlanOptions, runtime: dict | None = None):
    """The config `k3jax generate --mesh` runs, in the plan's dtype."""
    rt = {k: v for k, v in _runtime(opt).items() if k != "remat"}
    return k3.text.with_runtime(**{**rt, **(runtime or {})})


def prefill_tokens(preset, opt: PlanOptions, batch: int, n_devices: int) -> int:
    """Tokens per sequence of one prefill chunk: `opt.prefill_chunk` tokens per device (the
    planner's), spread over the sequences a device holds."""
    per_device_rows = max(1, batch // logical_shards(preset.rules, preset.shape(n_devices), ("batch",)))
    return max(1, opt.prefill_chunk // per_device_rows)


def serve_programs(k3: K3Config, preset_name: str, devices, opt: PlanOptions, runtime: dict | None = None,
                   physical: bool = True, new_tokens: int | None = None):
    """(first prefill, extend) for `opt.batch` sequences with caches of `opt.seq` tokens.

    The extend step continues full caches by `new_tokens` per sequence: a prefill chunk
    (default `prefill_tokens`) or, with new_tokens=1, a decode step. Its cache arrives with
    the shardings the first prefill gives it (what `generate` hands from one to the other);
    `cache_shardings_from(compiled first prefill)` fills them in."""
    from k3jax.infer.generate import extend_step, prefill_step
    preset = load_preset(preset_name)
    mesh, rules = load_mesh(preset, devices, physical=physical)
    batch = default_batch(preset, opt, len(devices))
    cfg = serve_config(k3, opt, runtime)
    n = new_tokens or prefill_tokens(preset, opt, batch, len(devices))
    check_layout(preset, len(devices), batch, 1)
    if opt.seq > cfg.max_position_embeddings or n > opt.seq:
        raise ConfigError(f"--seq {opt.seq} with {n} new tokens per sequence does not fit "
                          f"max_position_embeddings={cfg.max_position_embeddings}")
    rep = NamedSharding(mesh, P())
    with use_mesh(mesh, rules):
        params = abstract_params(cfg, mesh, rules)
    first = min(n, opt.seq)
    tok = lambda t: jax.ShapeDtypeStruct((batch, t), jnp.int32, sharding=rep)  # noqa: E731  (host ids: replicated)
    lens = jax.ShapeDtypeStruct((batch,), jnp.int32, sharding=rep)
    pre = Program("prefill_first", prefill_step, (cfg, params, tok(first), lens, opt.seq), mesh, rules, cfg,
                  tokens=batch * first, batch=batch, seq=opt.seq, new_tokens=first)
    ext = Program("decode" if n == 1 else "prefill", extend_step, (cfg, params, None, tok(n), lens), mesh, rules,
                  cfg, tokens=batch * n, batch=batch, seq=opt.seq, new_tokens=n)
    return pre, ext


def with_cache(ext: Program, compiled_prefill) -> Program:
    """The extend program with its cache typed as the compiled first prefill returns it."""
    pre_args = list(ext.args)
    cfg, params = pre_args[0], pre_args[1]
    from k3jax.infer.generate import prefill_step
    shapes = jax.eval_shape(lambda p, t, n: prefill_step(cfg, p, t, n, ext.seq), params,
                            jax.ShapeDtypeStruct((ext.batch, 1), jnp.int32),
                            jax.ShapeDtypeStruct((ext.batch,), jnp.int32))[1]
    cache_sh = compiled_prefill.output_shardings[1]
    cache = jax.tree.map(_sds, shapes, cache_sh)
    pre_args[2] = cache
    return dataclasses.replace(ext, args=tuple(pre_args))
