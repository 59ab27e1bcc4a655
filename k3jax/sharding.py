"""Param shardings and sharded init, beside the model: each param's NamedSharding from
its logical axes (k3jax.model's declarations) under a mesh's rules (k3jax.mesh).

The mesh API (presets, `load_mesh`, `use_mesh`, `batch_sharding`, ...) is k3jax.mesh's;
it is importable from here too, as every caller of a sharded model needs both.
"""
from __future__ import annotations

import jax
from flax import linen as nn
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from k3jax.mesh import (AXES, LOGICAL_AXES, MESH_DIR, MeshPreset, active_mesh_axes, batch_sharding,  # noqa: F401
                        entry_axes, fit_spec, load_mesh, load_preset, logical_shards, preset_for,
                        use_mesh)
from k3jax.config import ConfigError
from k3jax.model import abstract_variables, init_params


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
