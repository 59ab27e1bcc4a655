"""Meshes and logical-axis rules (the ground: imports nothing of k3jax but config and its file reader).

A mesh preset (`configs/meshes/NAME.yaml`) names the size of each mesh axis — `data`,
`fsdp`, `expert`, `tensor`, `context` — within a slice (`ici`) and across slices (`dcn`),
plus the rules table that maps the model's logical axis names (DESIGN.md) onto those mesh
axes: a shared table by name (`rules: zero3` for training, `rules: serve` for inference,
configs/meshes/rules/), changed per logical axis by `rules_override:`, or a whole table
inline. The model code never names a mesh axis; swapping the preset is the whole change
between 1 CPU device, 8 fake devices and a pod. Param shardings and sharded init live
in the model package (k3jax.model.params).

Typical use (what `k3jax train/logits/generate --mesh` call):

    mesh, rules = load_mesh("fsdp2_expert2_tensor2")
    params = init_params_sharded(cfg, key, mesh, rules)   # k3jax.model
    with use_mesh(mesh, rules):
        logits = jax.jit(apply_fn)(params, tokens)            # 'ep' MoE dispatch sees the mesh
"""
from __future__ import annotations

import contextlib
import dataclasses
import itertools
import math
import os
from dataclasses import dataclass, field

import jax
import numpy as np
from flax import linen as nn
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec as P

from k3jax.config import CONFIG_DIR, ConfigError, RuntimeOptions
from k3jax.configfiles import parse_yaml

AXES = ("data", "fsdp", "expert", "tensor", "context")
MESH_DIR = os.path.join(CONFIG_DIR, "meshes")
RULES_DIR = os.path.join(MESH_DIR, "rules")
# DESIGN.md's logical axes, plus `expert_mlp` (the routed experts' hidden: `mlp` is the dense
# MLPs', which inference splits over the same axis as the experts), `router` (the router's
# expert dim) and `low_rank` (the narrow side of a projection between embed and a bottleneck:
# q_a, kv_a, f_a, g_a and the latent MoE's down/up, whose embed side carries the ZeRO shards)
LOGICAL_AXES = ("batch", "length", "embed", "vocab", "heads", "heads_x_dim", "head_dim", "kda_rank",
                "conv", "q_lora", "kv_lora", "low_rank", "mlp", "expert_mlp", "latent", "expert", "router",
                "layers")


@dataclass(frozen=True)
class MeshPreset:
    """Axis sizes within a slice (`ici`, -1 = whatever devices are left) and across slices
    (`dcn`), the logical-axis rules, and the per-device memory the planner assumes."""
    name: str
    ici: dict
    dcn: dict = field(default_factory=dict)
    rules: tuple = ()
    device: str = ""
    hbm_gib: float | None = None
    train_preset: str | None = None   # the preset training on these devices uses instead
    context_preset: str | None = None  # same devices, each sequence split over a context axis:
                                       # what training uses when a batch has too few sequences
    runtime: dict = field(default_factory=dict)   # RuntimeOptions the preset was planned with:
                                       # defaults for plan, compile and train where not given

    @property
    def num_slices(self) -> int:
        return math.prod(self.dcn.values()) if self.dcn else 1

    def axis_order(self) -> tuple[str, ...]:
        # Axes that cross slices go first: the slow DCN links then carry the outermost
        # (least frequent, data-parallel-like) collectives, and create_hybrid_device_mesh
        # lays out each such axis slice-major.
        return tuple(a for a in AXES if self.dcn.get(a, 1) > 1) + tuple(a for a in AXES if self.dcn.get(a, 1) == 1)

    def shape(self, n_devices: int | None = None) -> dict:
        """Full axis sizes (ici × dcn), resolving one -1 from the device count."""
        ici = dict(self.ici)
        free = [a for a, s in ici.items() if s == -1]
        if len(free) > 1:
            raise ConfigError(f"mesh {self.name}: at most one axis may be -1, got {free}")
        if free:
            if n_devices is None:
                raise ConfigError(f"mesh {self.name}: axis {free[0]!r} is -1; give a device count")
            per_slice, rest = divmod(n_devices, self.num_slices * math.prod(s for s in ici.values() if s != -1))
            if rest or per_slice < 1:
                raise ConfigError(f"mesh {self.name}: {n_devices} devices do not divide into {ici} × {self.dcn}")
            ici[free[0]] = per_slice
        return {a: ici.get(a, 1) * self.dcn.get(a, 1) for a in AXES}

    def ici_shape(self, n_devices: int | None = None) -> dict:
        full = self.shape(n_devices)
        return {a: full[a] // self.dcn.get(a, 1) for a in AXES}


def rules_table(name: str) -> dict:
    """A shared rules table of configs/meshes/rules/ by name."""
    path = os.path.join(RULES_DIR, f"{name}.yaml")
    if not os.path.exists(path):
        names = sorted(f[:-5] for f in os.listdir(RULES_DIR) if f.endswith(".yaml"))
        raise ConfigError(f"no rules table {name!r} (tables: {names})")
    with open(path) as f:
        return parse_yaml(f.read(), path) or {}


def _preset_rules(name: str, d: dict) -> tuple:
    """A preset's `rules:` (a table's name or a whole table) with its `rules_override:`."""
    rules = d.get("rules") or {}
    if isinstance(rules, str):
        rules = rules_table(rules)
    elif not isinstance(rules, dict):
        raise ConfigError(f"mesh {name}: rules must name a table of configs/meshes/rules/ or be a mapping")
    override = d.get("rules_override") or {}
    if not isinstance(override, dict):
        raise ConfigError(f"mesh {name}: rules_override must be a mapping of logical axis -> mesh axes")
    return _rules_from_yaml(name, {**rules, **override})


def _rules_from_yaml(name: str, table: dict) -> tuple:
    unknown = sorted(set(table) - set(LOGICAL_AXES))
    if unknown:
        raise ConfigError(f"mesh {name}: unknown logical axes {unknown} (known: {LOGICAL_AXES})")
    # an axis left out would replicate every weight dim on it without a word: name each one
    missing = [a for a in LOGICAL_AXES if a not in table]
    if missing and table:     # (no table at all: every weight whole on every device, as written)
        raise ConfigError(f"mesh {name}: no rule for logical axes {missing} (write `AXIS: null` to keep "
                          f"a dim whole on every device)")
    rules = []
    for logical, mesh_axes in table.items():
        axes = entry_axes(mesh_axes)
        bad = [a for a in axes if a not in AXES]
        if bad:
            raise ConfigError(f"mesh {name}: rule {logical!r} names unknown mesh axes {bad}")
        rules.append((logical, None if not axes else axes[0] if len(axes) == 1 else axes))
    return tuple(rules)


def load_preset(preset_or_path) -> MeshPreset:
    """A preset name from configs/meshes/ or a path to a YAML file."""
    p = os.fspath(preset_or_path)
    if not os.path.exists(p):
        p = os.path.join(MESH_DIR, f"{preset_or_path}.yaml")
    if not os.path.exists(p):
        names = sorted(f[:-5] for f in os.listdir(MESH_DIR) if f.endswith(".yaml"))
        raise ConfigError(f"no mesh preset {preset_or_path!r} (presets: {names})")
    with open(p) as f:
        d = parse_yaml(f.read(), p) or {}
    name = os.path.splitext(os.path.basename(p))[0]
    unknown = sorted(set(d) - {"ici", "dcn", "rules", "rules_override", "device", "hbm_gib", "description",
                               "train_preset", "context_preset", "runtime"})
    if unknown:
        raise ConfigError(f"mesh {name}: unknown keys {unknown}")
    runtime = d.get("runtime") or {}
    known = {f.name for f in dataclasses.fields(RuntimeOptions)} - {"lora"}
    if not isinstance(runtime, dict) or set(runtime) - known:
        bad = sorted(set(runtime) - known) if isinstance(runtime, dict) else runtime
        raise ConfigError(f"mesh {name}: runtime names no RuntimeOptions field {bad} (fields: {sorted(known)})")
    for key in ("ici", "dcn"):
        bad = sorted(set(d.get(key) or {}) - set(AXES))
        if bad:
            raise ConfigError(f"mesh {name}: {key} names unknown mesh axes {bad} (axes: {AXES})")
    return MeshPreset(name, dict(d.get("ici") or {}), dict(d.get("dcn") or {}),
                      _preset_rules(name, d), d.get("device", ""), d.get("hbm_gib"),
                      d.get("train_preset"), d.get("context_preset"), dict(runtime))


def preset_for(preset_or_path, mode: str, batch: int | None = None, n_devices: int | None = None):
    """The preset to use for `mode` ('train' | 'infer'): an inference preset may name the
    layout training on the same devices uses (`train_preset:`), and a training preset the
    one a batch of `batch` sequences needs when they do not divide over its batch shards
    (`context_preset:`, each sequence over several chips; v5p-1024 at 128 sequences)."""
    preset = load_preset(preset_or_path)
    if mode == "train" and preset.train_preset:
        preset = load_preset(preset.train_preset)
    if mode == "train" and batch and preset.context_preset and batch % batch_shards(preset, n_devices):
        preset = load_preset(preset.context_preset)
    return preset


def logical_shards(rules, sizes: dict, logical: tuple[str, ...]) -> int:
    """How many ways `rules` split the logical axes `logical` over mesh axes of `sizes`."""
    return math.prod(sizes[a] for axes in nn.logical_to_mesh_axes(logical, rules) for a in entry_axes(axes))


def batch_shards(preset: MeshPreset, n_devices: int | None = None) -> int:
    """How many ways the preset's rules split a batch's sequences."""
    return logical_shards(preset.rules, preset.shape(n_devices), ("batch",))


def _device_grid(preset: MeshPreset, devices, physical: bool) -> np.ndarray:
    order = preset.axis_order()
    full, ici = preset.shape(len(devices)), preset.ici_shape(len(devices))
    if math.prod(full.values()) != len(devices):
        raise ConfigError(f"mesh {preset.name}: needs {math.prod(full.values())} devices, have {len(devices)}")
    if preset.num_slices > 1 and hasattr(devices[0], "slice_index"):
        from jax.experimental import mesh_utils
        return mesh_utils.create_hybrid_device_mesh([ici[a] for a in order],
                                                    [preset.dcn.get(a, 1) for a in order], devices)
    if preset.num_slices > 1:
        # No slice_index (CPU, single-slice GPU hosts): treat consecutive device groups as
        # the slices, the same slice-major layout create_hybrid_device_mesh produces.
        dcn = [preset.dcn.get(a, 1) for a in order]
        grid = np.asarray(devices, dtype=object).reshape(dcn + [ici[a] for a in order])
        n = len(order)
        grid = grid.transpose([i for pair in zip(range(n), range(n, 2 * n)) for i in pair])
        return grid.reshape([full[a] for a in order])
    if physical and devices[0].platform != "cpu":
        # topology-aware order on TPU / GPU; an error there is a real layout problem, so it
        # propagates rather than silently falling back to a slow device order
        from jax.experimental import mesh_utils
        shape = [full[a] for a in order]
        try:
            return mesh_utils.create_device_mesh(shape, devices)
        except NotImplementedError:
            # an axis that is no product of whole torus axes (v5p-1024-cp4's context 4 on an
            # 8x8x8 torus): split a physical axis, which keeps each mesh axis on a contiguous
            # ring of chips (found compiling v5p-1024-cp4 for v5p:8x8x8 ahead of time)
            return mesh_utils.create_device_mesh(shape, devices, allow_split_physical_axes=True)
    return np.asarray(devices, dtype=object).reshape([full[a] for a in order])


def load_mesh(preset_or_path, devices=None, physical: bool | None = None) -> tuple[Mesh, tuple]:
    """(Mesh with all five axes, Auto axis types, DCN axes outermost; logical rules) of a
    preset name, YAML path or MeshPreset. `physical`: lay TPU/GPU devices out by their
    topology (default: only for jax.devices()); ahead-of-time compiles pass a topology's
    devices with physical=True."""
    preset = preset_or_path if isinstance(preset_or_path, MeshPreset) else load_preset(preset_or_path)
    physical = devices is None if physical is None else physical
    devices = jax.devices() if devices is None else list(devices)
    grid = _device_grid(preset, devices, physical)
    order = preset.axis_order()
    # Auto axis types: sharding is propagated by XLA from the param shardings and the
    # logical constraints in the model (with_sharding_constraint needs Auto axes).
    return Mesh(grid, order, axis_types=(AxisType.Auto,) * len(order)), preset.rules


@contextlib.contextmanager
def use_mesh(mesh: Mesh, rules):
    """Make `mesh` the context mesh and `rules` the logical-axis rules: the model's
    activation constraints and the 'ep' MoE dispatch read both from here while tracing."""
    with jax.set_mesh(mesh), nn.logical_axis_rules(rules):
        yield


def entry_axes(entry) -> tuple[str, ...]:
    """The mesh axis names of one rules / PartitionSpec entry: None, a name or a tuple."""
    return () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)


def active_mesh_axes(logical: tuple[str, ...]) -> tuple[str, ...]:
    """The mesh axes of size > 1 that the active rules (`use_mesh`) map these logical axes
    to, in order, each once; () outside a mesh. Read while tracing."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty:
        return ()
    sizes = dict(mesh.shape)
    out = []
    for entry in nn.logical_to_mesh_axes(logical) or ():
        out += [a for a in entry_axes(entry) if sizes.get(a, 1) > 1 and a not in out]
    return tuple(out)


def fit_spec(shape, spec: P, sizes: dict) -> P:
    """Drop mesh axes from dims they do not divide (e.g. 4 heads over tensor 8): such a dim
    is replicated instead of unevenly padded, which shard_map and the planner can rely on."""
    out = []
    for dim, axes in zip(shape, tuple(spec) + (None,) * (len(shape) - len(spec))):
        kept = []
        for a in entry_axes(axes):
            if dim % (math.prod(sizes[b] for b in kept) * sizes[a]) == 0:
                kept.append(a)
        out.append(None if not kept else kept[0] if len(kept) == 1 else tuple(kept))
    return P(*out)


def row_axes(n: int, entry, sizes: dict) -> tuple[str, ...]:
    """Of a rules entry's mesh axes, those of size > 1 whose product is the largest that
    divides `n` rows, in order. 64 rollout slots over (fsdp 2, expert 64) go over expert,
    64 ways; fit_spec's prefix rule would keep fsdp alone, 2 ways, and copy every cache 256
    times over a 512-chip slice."""
    axes = [a for a in entry_axes(entry) if sizes[a] > 1]
    best, most = (), 1
    for k in range(1, len(axes) + 1):
        for sub in itertools.combinations(axes, k):
            size = math.prod(sizes[a] for a in sub)
            if n % size == 0 and size > most:
                best, most = sub, size
    return best


def batch_sharding(mesh: Mesh, rules, ndim: int = 2) -> NamedSharding:
    """Sharding of a [batch, length, ...] input under `rules`."""
    axes = ("batch", "length") + (None,) * (ndim - 2)
    return NamedSharding(mesh, nn.logical_to_mesh_axes(axes, rules))


def preset_runtime(preset: MeshPreset, given) -> dict:
    """The preset's runtime settings for the keys in no `given` (the user's flags, config
    section and overrides win): what plan, compile and train each add, and print."""
    return {k: v for k, v in preset.runtime.items() if k not in given}


def describe_runtime(preset_name: str, settings: dict) -> str:
    """The line plan, compile and train print for the settings a preset gave."""
    return f"runtime from mesh {preset_name}: " + ", ".join(f"{k}={v}" for k, v in settings.items())
