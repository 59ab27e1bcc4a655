"""Where params come from, in one place: random init, abstract shapes, logical axes and
shardings of the K3 model's params (and LoRA adapters).

Each param is declared once, where its module creates it (`layers.common.logical`: shape,
dtype, logical axes, initializer). This module reads those declarations through one
abstract trace (`param_infos`) and derives everything callers need from them: plain shapes
(`param_shapes`), PartitionSpecs under a mesh's rules (`param_specs`), NamedShardings
(`param_shardings`), and params initialised whole or born sharded (`init_params`,
`init_params_sharded`). Callers always get plain arrays; the logical-axis boxes stay here.
A checkpoint's params come from `k3jax.checkpoint.load`, placed with `param_shardings`.
"""
from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import linen as nn
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from k3jax.config import ModelConfig, RuntimeOptions
from k3jax.errors import ConfigError
from k3jax.layers.common import compute_dtype
from k3jax.layout import GROUPS, LayerPlan, layer_plan, slot_name, unrolled_name
from k3jax.mesh import entry_axes, fit_spec, use_mesh
from k3jax.model.transformer import LORA_KEY, DecoderLayer, K3Model, Residual, TopLevel


def _init_seed(rng, i: int):
    """uint32[4] seed material for part i, derived from the caller's key (any impl)."""
    key = jax.random.fold_in(rng, i)
    data = jax.random.key_data(key) if jnp.issubdtype(key.dtype, jax.dtypes.prng_key) else key
    data = data.reshape(-1).astype(jnp.uint32)
    return jnp.concatenate([data, data ^ jnp.uint32(0x9E3779B9)])[:4]


def _init_key(seed):
    # Init draws dozens of independent streams per layer; threefry's hash costs ~3x the
    # XLA CPU compile time of the RngBitGenerator behind 'unsafe_rbg', and init needs no
    # more than well-spread, reproducible values.
    return jax.random.wrap_key_data(seed, impl="unsafe_rbg")


# fold_in constant of the adapters' random stream: apart from every base stream
_LORA_STREAM = 0x4C6F5241


def init_params(cfg: ModelConfig, rng, length: int = 1):
    """Random params (a plain pytree, logical-axis boxes removed), shaped like `K3Model`'s,
    with the LoRA adapters under LORA_KEY when `cfg.runtime.lora` is set.

    Layers are initialised per kind — every (attention, ffn) kind once, vmapped over all
    layers of that kind — instead of through one `K3Model.init`: random-number code is
    costly to compile on CPU, and this compiles it once per kind instead of once per
    unrolled layer. Layer i draws from a key derived from fold_in(rng, i), so values do
    not depend on the scan plan; adapters draw from their own stream, so the base is the
    same with or without them.
    """
    plan = layer_plan(cfg)
    D = cfg.hidden_size
    h = jnp.zeros((1, length, D), compute_dtype(cfg))
    res = Residual(h, jnp.zeros((cfg.max_attn_res_blocks, 1, length, D), h.dtype), jnp.zeros((), jnp.int32))

    layers: dict[int, dict] = {}
    adapters: dict[int, dict] = {}
    by_kind: dict[tuple[str, str], list[int]] = {}
    for i, kind in enumerate(zip(cfg.layer_kinds, cfg.ffn_kinds)):
        by_kind.setdefault(kind, []).append(i)
    lora_rng = jax.random.fold_in(rng, _LORA_STREAM)

    def init_layer(layer, s, ls):
        v = nn.unbox(layer.init({"params": _init_key(s), LORA_KEY: _init_key(ls)}, res, None, 0))
        return v["params"], v.get(LORA_KEY, {})

    # Init traces each layer's forward under vmap (dead code XLA drops); the MoE's dense
    # dispatch keeps that trace free of shard_map and Pallas, whose batching rules need
    # not hold there. The dispatch is a runtime choice: the params are the same.
    init_cfg = cfg.with_runtime(moe_dispatch="dense") if cfg.num_experts else cfg
    for (attn_kind, ffn_kind), idx in by_kind.items():
        layer = DecoderLayer(init_cfg, attn_kind, ffn_kind)
        seeds = jnp.stack([_init_seed(rng, i) for i in idx])
        lora_seeds = jnp.stack([_init_seed(lora_rng, i) for i in idx])
        stacked, stacked_lora = jax.jit(jax.vmap(functools.partial(init_layer, layer)))(seeds, lora_seeds)
        for n, i in enumerate(idx):
            layers[i] = jax.tree.map(lambda x: x[n], stacked)
            adapters[i] = jax.tree.map(lambda x: x[n], stacked_lora)

    top_seed = _init_seed(rng, cfg.num_hidden_layers)
    params = jax.jit(lambda s: nn.unbox(TopLevel(cfg).init(_init_key(s), h)["params"]))(top_seed)
    params = _assemble(plan, dict(params), layers)
    if cfg.runtime.lora is not None:
        params[LORA_KEY] = _assemble(plan, {}, adapters)
    return params


def _assemble(plan: LayerPlan, tree: dict, layers: dict[int, dict]) -> dict:
    """Per-layer trees into the model's layout: `layers_{i}` unrolled, `groups/sub_{j}`
    stacked over the scanned groups (subtrees left empty by a layer are omitted)."""
    for i in plan.head + plan.tail:
        if layers[i]:
            tree[unrolled_name(i)] = layers[i]
    if plan.n_groups:
        groups = {}
        for j in range(plan.group_size):
            members = [layers[plan.group_start + g * plan.group_size + j] for g in range(plan.n_groups)]
            if members[0]:
                groups[slot_name(j)] = jax.tree.map(lambda *xs: jnp.stack(xs), *members)
        if groups:
            tree[GROUPS] = groups
    return tree


# runtime options that shape how the model runs, never its params: one trace serves them all
# (the planner varies the exchange buffer and remat when it looks for a setting that fits)
_NOT_SHAPING = ("kda_impl", "kda_chunk_size", "ep_exchange", "ep_capacity_factor", "ep_first_round", "ep_buffer_mib",
                "attention_q_block", "decode_attention", "remat", "qat", "optimizer_offload")


def _abstract_variables(cfg: ModelConfig):
    # a fresh tree each call (callers may edit theirs) over one trace per config: ~5 s for K3
    default = RuntimeOptions()
    cfg = cfg.with_runtime(**{k: getattr(default, k) for k in _NOT_SHAPING})
    return jax.tree.map(lambda x: x, _traced_variables(cfg))


@functools.lru_cache(maxsize=16)
def _traced_variables(cfg: ModelConfig):
    tokens = jax.ShapeDtypeStruct((1, 1), jnp.int32)
    # the forward is traced only for the params it declares: the dense MoE dispatch as
    # init_params, and KDA's plain recurrence (K3's trace 3.35 s -> 1.99 s), same params
    cfg = cfg.with_runtime(kda_impl="recurrent", **({"moe_dispatch": "dense"} if cfg.num_experts else {}))

    def init(t):
        # the key made inside the trace: nothing runs eagerly, so a context mesh over devices
        # that cannot execute (a TPU topology compiled for on a CPU host) is never asked to
        key = jax.random.PRNGKey(0)
        return K3Model(cfg).init({"params": key, LORA_KEY: key}, t)
    return jax.eval_shape(init, tokens)


def abstract_params(cfg: ModelConfig):
    """The base param shapes and dtypes (logical-axis boxes kept) via `jax.eval_shape`:
    nothing is allocated. Adapters are `abstract_adapters`."""
    return _abstract_variables(cfg)["params"]


def abstract_variables(cfg: ModelConfig):
    """`abstract_params`, with the adapters under LORA_KEY when `cfg.runtime.lora` is set:
    the tree `init_params` returns, as boxed shapes."""
    boxed = abstract_params(cfg)
    return {**boxed, LORA_KEY: abstract_adapters(cfg)} if cfg.runtime.lora is not None else boxed


def abstract_adapters(cfg: ModelConfig):
    """The LoRA adapters' shapes and logical axes ({} without `cfg.runtime.lora`)."""
    if cfg.runtime.lora is None:
        return {}
    return _abstract_variables(cfg).get(LORA_KEY, {})


class ParamInfo(NamedTuple):
    """One param as declared: shape, dtype and logical axis names (None for an axis no rule
    names; () for a param declared without names)."""
    shape: tuple[int, ...]
    dtype: jnp.dtype
    axes: tuple[str | None, ...]


def _info(x) -> ParamInfo:
    if isinstance(x, nn.Partitioned):
        return ParamInfo(tuple(x.value.shape), x.value.dtype, tuple(x.names))
    return ParamInfo(tuple(x.shape), x.dtype, ())


def param_infos(cfg: ModelConfig) -> dict:
    """`ParamInfo` per param of the tree `init_params` returns (adapters under LORA_KEY
    with `cfg.runtime.lora`)."""
    return jax.tree.map(_info, abstract_variables(cfg), is_leaf=lambda x: isinstance(x, nn.Partitioned))


def param_shapes(cfg: ModelConfig, adapters: bool = False) -> dict:
    """Plain `jax.ShapeDtypeStruct`s of the base params (with `adapters`, the LoRA adapters
    under LORA_KEY as well, when `cfg.runtime.lora` is set): nothing is allocated."""
    return _unboxed(abstract_variables(cfg) if adapters else abstract_params(cfg))


def adapter_shapes(cfg: ModelConfig) -> dict:
    """Plain shapes of the LoRA adapters ({} without `cfg.runtime.lora`)."""
    return _unboxed(abstract_adapters(cfg))


def _unboxed(boxed):
    # a plain unwrap: nn.unbox would constrain to the logical names under a context mesh
    return jax.tree.map(lambda x: x.value if isinstance(x, nn.Partitioned) else x, boxed,
                        is_leaf=lambda x: isinstance(x, nn.Partitioned))


def param_specs(boxed, rules, sizes: dict) -> dict:
    """PartitionSpec per param of a boxed abstract tree (`abstract_params`): its logical
    names under `rules`, each mesh axis kept only on dims it divides (`fit_spec`). A dim
    whose rule names a mesh axis (of size > 1) another dim of the same weight already took
    is a ConfigError naming the param: flax would leave that dim unsharded without a word,
    which is how inference presets once split the routed experts over their hidden."""
    table = dict(rules)

    def one(path, x):
        if not isinstance(x, nn.Partitioned):
            return P()
        names = tuple(x.names)
        got = nn.logical_to_mesh_axes(names, rules)
        for name, entry in zip(names, got):
            want = [a for a in entry_axes(table.get(name)) if sizes.get(a, 1) > 1] if name else []
            if want and not entry_axes(entry):
                taken = {a: n for n, e in zip(names, got) for a in entry_axes(e)}
                clash = ", ".join(f"{a!r} (taken by {taken[a]!r})" for a in want if a in taken)
                raise ConfigError(f"sharding rules: param {jax.tree_util.keystr(path)} {names}: rule "
                                  f"{name!r} -> {table[name]!r} cannot apply, mesh axis {clash} is used twice; "
                                  "give the dim its own logical name or change the rules")
        # plain unwrap: nn.unbox would apply sharding constraints under a context mesh
        return fit_spec(x.value.shape, P(*got), sizes)

    return jax.tree_util.tree_map_with_path(one, boxed, is_leaf=lambda x: isinstance(x, nn.Partitioned))


def param_shardings(cfg, mesh: Mesh, rules) -> dict:
    """NamedSharding per param (same tree as `init_params`, adapters included), from the
    logical names (`param_specs`)."""
    specs = param_specs(abstract_variables(cfg), rules, dict(mesh.shape))
    return jax.tree.map(lambda s: NamedSharding(mesh, s), specs, is_leaf=lambda x: isinstance(x, P))


def init_params_sharded(cfg, key, mesh: Mesh, rules) -> dict:
    """`init_params` compiled as one jit whose outputs are born sharded: each device
    computes only its own shards, nothing passes through one host's memory. Values equal
    `init_params(cfg, key)` (same random streams)."""
    shardings = param_shardings(cfg, mesh, rules)
    with use_mesh(mesh, rules):
        return jax.jit(lambda k: init_params(cfg, k), out_shardings=shardings)(key)


def shard_params(params, shardings):
    """Place an existing params tree (host arrays or restored arrays) onto `shardings`."""
    return jax.tree.map(lambda x, s: jax.device_put(x, s), params, shardings)
