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
                        entry_axes, fit_spec, load_mesh, load_preset, preset_for, use_mesh)
from k3jax.model import LORA_KEY, abstract_adapters, abstract_params, init_params


def param_shardings(cfg, mesh: Mesh, rules) -> dict:
    """NamedSharding per param (same tree as `init_params`, adapters included), from the
    logical names."""
    boxed = abstract_params(cfg)
    if cfg.runtime.lora is not None:
        boxed = {**boxed, LORA_KEY: abstract_adapters(cfg)}
    specs = nn.get_partition_spec(boxed)
    # plain unwrap: nn.unbox would apply sharding constraints to shapes under a context mesh
    shapes = jax.tree.map(lambda x: x.value, boxed, is_leaf=lambda x: isinstance(x, nn.Partitioned))
    mesh_specs = nn.logical_to_mesh(specs, rules)
    return jax.tree.map(lambda s, x: NamedSharding(mesh, fit_spec(x.shape, s, dict(mesh.shape))), mesh_specs, shapes,
                        is_leaf=lambda x: isinstance(x, P))


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
