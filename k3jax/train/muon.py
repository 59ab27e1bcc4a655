"""Per-Head Muon for K3, assembled from optax building blocks.

Every param gets a *group* from its path and the layer kind (`param_groups`):

  muon_head    KDA q/k/v_proj, MLA q_b_proj (or q_proj): orthogonalised per attention head
  muon_kv_b    MLA kv_b_proj: per head, k_nope and v blocks separately (or the whole head block)
  muon_expert  stacked routed experts w1/w2/w3: per expert
  muon         every other matrix (o_proj, g_proj, LoRA down-projections, router gate, dense MLPs)
  adamw        embeddings (token, vision positions), lm_head, conv weights (decoupled decay)
  adamw_nodecay norms, AttnRes vectors, A_log, dt_bias (no decay: they are scales, not features)
  router_bias  e_score_correction_bias: never touched by the optimizer; Quantile Balancing owns it
  frozen       anything matching a `freeze` pattern (a glob on the param path, e.g. '*/w[123]',
               or 're:' + a regex), MXFP4-resident experts (integers) and, with LoRA on, the
               whole base: no gradient, no optimizer state. A router whose gate or bias is
               frozen also keeps its bias (Quantile Balancing skips it)
  lora         LoRA adapters (under params['lora']): AdamW, or Muon with `lora.optimizer: muon`

Muon runs in a *block view*: each matrix is reshaped to [..batch.., fan_in, fan_out] where the
batch axes are the scan `layers` axis, the expert axis and the head axis. optax's
`scale_by_muon` vmaps Newton–Schulz over those batch axes, so the per-head orthogonalisation
is one batched computation, never a Python loop over heads. kv_b's split view is a dict of two
blocks ({'k': [.., H, r, dn], 'v': [.., H, r, dv]}) because the two widths can differ.

Two readings of K3's rule exist in public trainers; both are switches:
  kv_b_mode    'split' (default): k_nope and v orthogonalised separately; 'whole': one
               [r, dn+dv] block per head.
  muon_scaling 'block' (default): Moonlight's 0.2·√max(fan_in, fan_out) of the orthogonalised
               block (optax `scale_by_shape`); 'full': of the whole 2-D matrix the block came from.
"""
from __future__ import annotations

import fnmatch
import math
import re
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import optax
from optax.contrib import MuonDimensionNumbers, MuonState, scale_by_muon
from optax.contrib._muon import orthogonalize_via_newton_schulz, scale_by_shape

from k3jax.config import ModelConfig, expert_role
from k3jax.layout import attention_kind, is_scanned, stacked_axes
from k3jax.mesh import entry_axes
from k3jax.train import muon_dist

MUON_GROUPS = ("muon", "muon_head", "muon_kv_b", "muon_expert")
GROUPS = MUON_GROUPS + ("adamw", "adamw_nodecay", "router_bias", "frozen", "lora")
# groups that get gradients (and optimizer state)
TRAINED = MUON_GROUPS + ("adamw", "adamw_nodecay", "lora")
# Every view puts the matrix in the last two axes; all leading axes are batch axes.
_BLOCK_DIMS = MuonDimensionNumbers(reduction_axis=-2, output_axis=-1)


def path_str(path) -> str:
    return "/".join(str(getattr(k, "key", getattr(k, "idx", k))) for k in path)


def _frozen_by(path: str, freeze) -> bool:
    return any(re.search(pat[3:], path) if pat.startswith("re:") else fnmatch.fnmatchcase(path, pat)
               for pat in freeze)


def classify(cfg: ModelConfig, path: str, shape: tuple[int, ...], freeze=(), dtype=None,
             lora: bool = False) -> str:
    """The optimizer group of one param (see the module docstring); `lora`: adapters train
    and the base is frozen."""
    parts = path.split("/")
    if parts[0] == "lora":
        return "lora"
    name = parts[-2] if parts[-1] in ("kernel", "weight", "embedding") else parts[-1]
    if parts[-1] == "e_score_correction_bias":
        gate = "/".join(parts[:-1] + ["gate"])
        return "frozen" if _frozen_by(path, freeze) or _frozen_by(gate, freeze) else "router_bias"
    if lora or _frozen_by(path, freeze) or (dtype is not None and not jnp.issubdtype(dtype, jnp.floating)):
        return "frozen"
    if name in ("embed_tokens", "lm_head", "pos_emb"):  # pos_emb: the vision position table
        return "adamw"
    if name.endswith("_conv1d"):
        return "adamw"
    stacked = stacked_axes(parts)
    if len(shape) - stacked < 2 or name in ("A_log", "dt_bias") or "norm" in name or name.endswith("_res"):
        return "adamw_nodecay"
    if expert_role(parts) == name:
        return "muon_expert"
    kind = attention_kind(cfg, parts)
    if kind == "kda" and name in ("q_proj", "k_proj", "v_proj"):
        return "muon_head"
    if kind == "mla" and name in ("q_b_proj", "q_proj"):
        return "muon_head"
    if kind == "mla" and name == "kv_b_proj":
        return "muon_kv_b"
    return "muon"


def param_groups(cfg: ModelConfig, params, freeze=()):
    """A tree like `params` (arrays or ShapeDtypeStructs, boxed or not) of group names.
    Adapters under params['lora'] turn LoRA on: the base is then frozen."""
    lora = isinstance(params, dict) and "lora" in params
    return jax.tree_util.tree_map_with_path(
        lambda p, x: classify(cfg, path_str(p), tuple(x.shape), freeze, getattr(x, "dtype", None), lora), params)


def trained_mask(groups):
    """True where a param gets gradients and optimizer state."""
    return jax.tree.map(lambda g: g in TRAINED, groups)


# ---------------------------------------------------------------------------------------
# Block views
# ---------------------------------------------------------------------------------------
def _head_dim(cfg: ModelConfig, path: str) -> tuple[int, int]:
    parts = path.split("/")
    if attention_kind(cfg, parts) == "kda":
        return cfg.kda_num_heads, cfg.kda_head_dim
    return cfg.num_attention_heads, cfg.q_head_dim


def _to_view(cfg, group, kv_b_mode, path, x):
    if group == "muon_head":
        H, d = _head_dim(cfg, path)
        v = jnp.moveaxis(x.reshape(*x.shape[:-1], H, d), -2, -3)              # [.., H, in, d]
    elif group == "muon_kv_b":
        H, dn = cfg.num_attention_heads, cfg.qk_nope_head_dim
        blocks = jnp.moveaxis(x.reshape(*x.shape[:-1], H, dn + cfg.v_head_dim), -2, -3)
        v = blocks if kv_b_mode == "whole" else {"k": blocks[..., :dn], "v": blocks[..., dn:]}
    else:
        v = x                                                                  # [.., in, out]
    return _layers_last(v) if _stacked(path) else v


def _stacked(path: str) -> bool:
    """Whether a param (or a LoRA adapter, under 'lora/') carries the scanned layers axis."""
    parts = path.split("/")
    return is_scanned(parts[1:] if parts[0] == "lora" else parts)


def _layers_last(v, inverse: bool = False):
    """[layers, *batch, in, out] <-> [*batch, layers, in, out]. optax flattens a view's
    batch axes into one; with the (never sharded) scanned `layers` axis in front, a sharded
    axis behind it (experts over `expert`) cannot stay sharded in the flattened axis, and
    XLA replicated every expert's Newton–Schulz on every device (5 TiB per device for K3
    on v5p-1024, found by `k3jax compile`). Last among the batch axes it keeps them split."""
    if isinstance(v, dict):
        return {k: _layers_last(x, inverse) for k, x in v.items()}
    if v.ndim <= 3:
        return v
    return jnp.moveaxis(v, -3, 0) if inverse else jnp.moveaxis(v, 0, -3)


def view_deals(cfg: ModelConfig, groups, placed, kv_b_mode: str = "split") -> dict:
    """{param path: muon_dist.Deal} for the Muon params whose block views are dealt out over
    their mesh (`placed`: params or ShapeDtypeStructs carrying NamedShardings); the others'
    Newton–Schulz is left to XLA. A split kv_b view's two blocks share their batch dims,
    hence one deal."""
    group_of = {path_str(p): g for p, g in jax.tree_util.tree_leaves_with_path(groups)}
    out = {}
    for p, x in jax.tree_util.tree_leaves_with_path(placed):
        path, where = path_str(p), muon_dist.view_spec(getattr(x, "sharding", None))
        group = group_of.get(path)
        if where is None or group not in MUON_GROUPS:
            continue
        layout = _view_layout(cfg, group, path, x.shape, *where)
        view = jax.eval_shape(lambda v: _to_view(cfg, group, kv_b_mode, path, v), jax.ShapeDtypeStruct(x.shape, x.dtype))
        deal = muon_dist.plan(jax.tree.leaves(view)[0].shape, *layout) if layout is not None else None
        if deal is not None:
            out[path] = deal
    return out


def _view_layout(cfg, group, path, shape, spec, mesh):
    """(the PartitionSpec of a param's block view, `_to_view`'s reshapes applied to the
    param's own spec; the mesh), or None where the view splits a sharded dim unevenly."""
    sizes = dict(mesh.shape)
    spec = list(spec) + [None] * (len(shape) - len(spec))
    if group in ("muon_head", "muon_kv_b"):
        heads = _head_dim(cfg, path)[0] if group == "muon_head" else cfg.num_attention_heads
        if heads % math.prod(sizes[a] for a in entry_axes(spec[-1])):
            return None
        spec = spec[:-2] + [spec[-1], spec[-2], None]                          # [.., H, in, d]
    if _stacked(path) and len(spec) > 3:
        spec = spec[1:-2] + [spec[0]] + spec[-2:]                              # _layers_last
    return tuple(spec), mesh


def _from_view(group, kv_b_mode, shape, v, stacked: bool = False):
    if stacked:
        v = _layers_last(v, inverse=True)
    if group == "muon_kv_b" and kv_b_mode == "split":
        v = jnp.concatenate([v["k"], v["v"]], axis=-1)
    if group in ("muon_head", "muon_kv_b"):
        return jnp.moveaxis(v, -3, -2).reshape(shape)
    return v


def per_block_muon(cfg: ModelConfig, groups, *, beta=0.95, ns_steps=5, rms=0.2, kv_b_mode="split",
                   scaling="block", nesterov=True, mu_dtype=jnp.float32, placed=None) -> optax.GradientTransformation:
    """optax `scale_by_muon` (+ `scale_by_shape` for block scaling) run on block views.

    `groups`: the full group tree (from `param_groups`); the transform only ever sees the
    muon leaves (others are optax MaskedNodes under `optax.partition`), found by path.
    `placed`: the params (arrays or ShapeDtypeStructs) whose NamedShardings say how the
    views are laid out: on a mesh each view's blocks are orthogonalised whole, each on one
    device (`muon_dist`); None: XLA shards Newton–Schulz as it propagates.
    """
    if kv_b_mode not in ("split", "whole"):
        raise ValueError(f"kv_b_mode must be 'split' or 'whole', got {kv_b_mode!r}")
    if scaling not in ("block", "full"):
        raise ValueError(f"muon_scaling must be 'block' or 'full', got {scaling!r}")
    group_of = {path_str(p): g for p, g in jax.tree_util.tree_leaves_with_path(groups)}
    deals = view_deals(cfg, groups, placed, kv_b_mode) if placed is not None else {}
    dims = lambda tree: jax.tree.map(lambda _: _BLOCK_DIMS, tree)
    inner = _scale_by_layerwise_muon(ns_steps, beta, nesterov, mu_dtype)
    if scaling == "block":
        inner = optax.chain(inner, scale_by_shape(dims, consistent_rms=rms))

    def views(tree):
        return jax.tree_util.tree_map_with_path(
            lambda p, x: _to_view(cfg, group_of[path_str(p)], kv_b_mode, path_str(p), x), tree)

    def init(params):
        return inner.init(views(params))

    def update(updates, state, params=None):
        del params  # Muon's direction does not depend on the params; decay comes later
        orth = jax.tree_util.tree_map_with_path(
            lambda p, _: _Orth(_stacked(path_str(p)), deals.get(path_str(p))), updates)
        out, state = inner.update(views(updates), state, orth)
        treedef = jax.tree.structure(updates)
        paths = [path_str(p) for p, _ in jax.tree_util.tree_leaves_with_path(updates)]
        shapes = [x.shape for x in jax.tree.leaves(updates)]
        blocks = treedef.flatten_up_to(out)
        leaves = []
        for path, shape, v in zip(paths, shapes, blocks):
            u = _from_view(group_of[path], kv_b_mode, shape, v, _stacked(path))
            if scaling == "full":
                u = u * (rms * math.sqrt(max(shape[-2], shape[-1])))
            leaves.append(u)
        return jax.tree.unflatten(treedef, leaves), state

    return optax.GradientTransformation(init, update)


@dataclass(frozen=True)
class _Orth:
    """How one param's views are orthogonalised: whether they carry the scanned layers axis
    (at -3), and how their blocks are dealt out over the mesh (None: left to XLA)."""
    stacked: bool
    deal: muon_dist.Deal | None = None


def _orthogonalize_all(orth, views, coeffs, ns_steps: int):
    """Every view orthogonalised as its `_Orth` says, the dealt ones together
    (`muon_dist.orthogonalize_many` packs those that can share a deal)."""
    flat_o, treedef = jax.tree.flatten(orth, is_leaf=lambda x: isinstance(x, _Orth))
    per_param = treedef.flatten_up_to(views)
    leaves = [jax.tree.flatten(v) for v in per_param]          # a split kv_b view has two
    out = [[None] * len(xs) for xs, _ in leaves]
    dealt = []
    for j, (o, (xs, _)) in enumerate(zip(flat_o, leaves)):
        for m, x in enumerate(xs):
            if o.deal is None:
                out[j][m] = _newton_schulz(x, coeffs, ns_steps, o.stacked)
            else:
                dealt.append((j, m, x, o))
    if dealt:
        ys = muon_dist.orthogonalize_many([x for _, _, x, _ in dealt], [o.deal for *_, o in dealt],
                                          _ns_block(coeffs, ns_steps),
                                          [x.shape[-3] if o.stacked else 1 for _, _, x, o in dealt])
        for (j, m, _, _), y in zip(dealt, ys):
            out[j][m] = y
    return treedef.unflatten([jax.tree.unflatten(d, ys) for ys, (_, d) in zip(out, leaves)])


def _ns_block(coeffs, ns_steps: int):
    """Newton–Schulz of the [in, out] blocks in a view's last two axes.

    Given one coefficient row per iteration, optax scans the iterations where a single row
    unrolls them: the same arithmetic, each iteration's kernels compiled once instead of
    ns_steps times (a one-layer toy's sharded Muon update compiled and ran in 23 s, not 37)."""
    rows = jnp.broadcast_to(coeffs, (ns_steps, coeffs.shape[-1])) if coeffs.ndim == 1 else coeffs
    return lambda b: orthogonalize_via_newton_schulz(b, rows, ns_steps, "frobenius", 1e-8, _BLOCK_DIMS)


def _newton_schulz(x, coeffs, ns_steps: int, stacked: bool):
    """Orthogonalise every [in, out] block of a view, one scanned layer at a time.

    All blocks at once (optax's vmap over every batch axis) can keep every block's fp32
    Newton–Schulz temporaries alive together: on v5p-1024 a stacked expert leaf's [3072,
    3072] Gram matrices for 14 local experts × 22 layers are 10.8 GiB per device, and K3 has
    12 such leaves. A `lax.map` over the scanned layers axis (at -3 in a stacked view)
    holds one layer's; the math is the same block by block."""
    ns = _ns_block(coeffs, ns_steps)
    if not stacked or x.ndim < 3:
        return ns(x)
    return jnp.moveaxis(jax.lax.map(ns, jnp.moveaxis(x, -3, 0)), 0, -3)


def _scale_by_layerwise_muon(ns_steps: int, beta: float, nesterov: bool, mu_dtype) -> optax.GradientTransformation:
    """optax `scale_by_muon`'s update (its state, momentum and Nesterov correction), with the
    orthogonalisation run per scanned layer (`_newton_schulz`) or dealt out over the mesh
    (`muon_dist`). `update` takes, in place of params, a tree of `_Orth` saying which."""
    base = scale_by_muon(ns_steps=ns_steps, beta=beta, nesterov=nesterov, mu_dtype=mu_dtype)

    def update(updates, state, orth):
        mu = optax.tree.update_moment(updates, state.mu, beta, 1)
        count = optax.safe_increment(state.count)
        if nesterov:
            mu_hat = jax.tree.map(lambda m, g: beta * m + (1 - beta) * g,
                                  optax.tree.bias_correction(mu, beta, optax.safe_increment(count)),
                                  optax.tree.bias_correction(updates, beta, count))
        else:
            mu_hat = optax.tree.bias_correction(mu, beta, count)
        out = _orthogonalize_all(orth, mu_hat, state.ns_coeffs, ns_steps)
        return out, MuonState(count=count, mu=optax.tree.cast(mu, mu_dtype), ns_coeffs=state.ns_coeffs)

    return optax.GradientTransformation(base.init, update)


# ---------------------------------------------------------------------------------------
# The whole optimizer
# ---------------------------------------------------------------------------------------
def schedule(o: dict, steps: int, peak: float):
    """Linear warmup over `warmup_steps`, then cosine to min_lr_ratio·peak, or constant."""
    warm = max(int(o["warmup_steps"]), 0)
    floor = peak * float(o["min_lr_ratio"])
    decay = max(steps - warm, 1)

    def lr(count):
        count = jnp.asarray(count, jnp.float32)
        ramp = jnp.minimum((count + 1.0) / warm, 1.0) if warm else 1.0
        if o["schedule"] == "constant":
            return peak * ramp
        frac = jnp.clip((count - warm) / decay, 0.0, 1.0)
        return ramp * (floor + (peak - floor) * 0.5 * (1.0 + jnp.cos(jnp.pi * frac)))
    return lr


def build_optimizer(cfg: ModelConfig, params, o: dict, steps: int, lora: dict | None = None):
    """(optax transform over the trained params, group tree of all params). `o` is the
    train config's `optimizer` section, `lora` its resolved `lora` section (adapters
    present under params['lora']).

    The transform sees only the trained leaves (`trained_mask`; the rest are None in the
    trees it gets), so frozen params have no optimizer state at all. Gradients reach it in
    fp32 (the step casts them), so all optimizer state is fp32 even with bf16 params.
    Clipping is by the global norm of the trained grads.
    """
    groups = param_groups(cfg, params, tuple(o.get("freeze") or ()))
    lr = schedule(o, steps, float(o["lr"]))
    adam_lr = schedule(o, steps, float(o["adam_lr"] if o.get("adam_lr") is not None else o["lr"]))
    wd = float(o["weight_decay"])
    muon = optax.chain(
        per_block_muon(cfg, groups, beta=float(o["muon_beta"]), ns_steps=int(o["ns_steps"]),
                       rms=float(o["muon_rms"]), kv_b_mode=o["kv_b_mode"], scaling=o["muon_scaling"],
                       placed=params),
        optax.add_decayed_weights(wd),       # decoupled: decay is scaled by lr, not by the Muon step
        optax.scale_by_learning_rate(lr))
    adam = lambda decay: optax.adamw(adam_lr, b1=float(o["b1"]), b2=float(o["b2"]), eps=float(o["eps"]),
                                     weight_decay=decay, mu_dtype=jnp.float32)
    label = lambda g: "muon" if g in MUON_GROUPS else g
    transforms = {"muon": muon, "adamw": adam(wd), "adamw_nodecay": adam(0.0)}
    if lora is not None:
        lora_lr = schedule(o, steps, float(lora["lr"] if lora.get("lr") is not None
                                           else o["adam_lr"] if o.get("adam_lr") is not None else o["lr"]))
        if lora.get("optimizer", "adamw") == "muon":
            # adapter matrices orthogonalised whole ([.., in, r], [.., r, out]; per expert for
            # stacked experts), with Moonlight's RMS matching
            lora_groups = jax.tree.map(lambda g: "muon" if g == "lora" else g, groups)
            transforms["lora"] = optax.chain(
                per_block_muon(cfg, lora_groups, beta=float(o["muon_beta"]), ns_steps=int(o["ns_steps"]),
                               rms=float(o["muon_rms"]), placed=params),
                optax.add_decayed_weights(wd), optax.scale_by_learning_rate(lora_lr))
        else:
            transforms["lora"] = optax.adamw(lora_lr, b1=float(o["b1"]), b2=float(o["b2"]), eps=float(o["eps"]),
                                             weight_decay=wd, mu_dtype=jnp.float32)
    labels = jax.tree.map(lambda g: label(g) if g in TRAINED else None, groups)
    used = {lb for lb in jax.tree.leaves(labels)}
    tx = optax.partition({k: v for k, v in transforms.items() if k in used}, labels)
    clip = float(o.get("grad_clip") or 0.0)
    if clip > 0:
        tx = optax.chain(optax.clip_by_global_norm(clip), tx)
    return tx, groups
