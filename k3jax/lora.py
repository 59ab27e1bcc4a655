"""LoRA targets: the train config's `lora:` section resolved against a model into a `LoraSpec`.

    lora:
      rank: 16              # 0 = off (full fine-tuning)
      alpha: 32             # scale alpha / rank (null: alpha = rank, scale 1)
      expert_rank: null     # rank of the routed-expert adapters (null: rank)
      expert_mode: per_expert   # or shared_a: one A [in, r] for all experts, B per expert
      targets: null         # globs over module paths (null: DEFAULT_TARGETS)
      optimizer: adamw      # or muon (Per-Head Muon's rules on the adapter matrices)
      lr: null              # peak lr of the adapters (null: optimizer.adam_lr, else optimizer.lr)

Targets are fnmatch globs ('*' also crosses '/') or 're:'-prefixed regexes over module
paths such as `groups/sub_0/self_attn/q_proj`, `layers_0/mlp/down_proj` or
`groups/sub_1/block_sparse_moe/w1` (the routed experts, one adapter stack per weight);
`.../kernel` paths match too. Only bias-free projections and routed experts can be
targets. Scanned layers share one structure, so a projection is adapted in every layer
that has it or in none: a glob that selects it in some layers only is an error, and so is
a glob that selects nothing.

With LoRA on, the base is frozen: only the adapters get gradients and optimizer state,
and checkpoints hold the adapters (plus the router biases Quantile Balancing keeps
re-solving), not the base, which comes back from `init_from` (or the seed) on resume.
"""
from __future__ import annotations

import fnmatch
import re

import jax
from flax import linen as nn

from k3jax.config import ConfigError, LoraSpec, ModelConfig, expert_role
from k3jax.layout import split_layer_prefix

DEFAULT_TARGETS = (
    "*/self_attn/*_proj",                   # every KDA and MLA projection
    "*/self_attn/kv_a_proj_with_mqa",
    "*/mlp/*_proj",                         # the dense MLP
    "*/shared_experts/*_proj",
    "*/block_sparse_moe/w[123]",            # routed experts
)

DEFAULTS = {"rank": 0, "alpha": None, "expert_rank": None, "expert_mode": "per_expert",
            "targets": None, "optimizer": "adamw", "lr": None}


def _matches(pattern: str, path: str) -> bool:
    if pattern.startswith("re:"):
        return re.search(pattern[3:], path) is not None
    return fnmatch.fnmatchcase(path, pattern)


def candidate_modules(abstract_params) -> list[str]:
    """Module paths that can carry adapters: projections (a `kernel` leaf) and routed
    expert stacks (`block_sparse_moe/w1..w3`, widened or MXFP4), inside decoder layers."""
    out = set()
    for path, _ in jax.tree_util.tree_leaves_with_path(nn.unbox(abstract_params)):
        keys = [str(getattr(k, "key", k)) for k in path]
        prefix, rest = split_layer_prefix(keys)
        if not prefix:
            continue
        if keys[-1] == "kernel":
            out.add("/".join(keys[:-1]))
        elif expert_role(rest[:2]):
            out.add("/".join(prefix + tuple(rest[:2])))
    return sorted(out)


def resolve(section: dict | None, cfg: ModelConfig, abstract_params) -> LoraSpec | None:
    """The LoraSpec of a train config's `lora:` section for this model (None when rank 0)."""
    s = {**DEFAULTS, **(section or {})}
    unknown = sorted(set(s) - set(DEFAULTS))
    if unknown:
        raise ConfigError(f"config key train.lora.{unknown[0]}: unknown key (known: {sorted(DEFAULTS)})")
    rank = s["rank"]
    if isinstance(rank, bool) or not isinstance(rank, int) or rank < 0:
        raise ConfigError(f"config key train.lora.rank: must be a non-negative integer ({rank!r})")
    if rank == 0:
        return None
    if s["optimizer"] not in ("adamw", "muon"):
        raise ConfigError(f"config key train.lora.optimizer: expected 'adamw' or 'muon' ({s['optimizer']!r})")
    targets = list(DEFAULT_TARGETS) if s["targets"] is None else s["targets"]
    if isinstance(targets, str) or not isinstance(targets, (list, tuple)) or not targets:
        raise ConfigError(f"config key train.lora.targets: expected a non-empty list of globs ({targets!r})")
    modules = candidate_modules(abstract_params)
    selected: set[str] = set()
    for pat in targets:
        hit = [m for m in modules if _matches(pat, m) or _matches(pat, m + "/kernel")]
        if not hit:
            raise ConfigError(f"config key train.lora.targets: {pat!r} matches no projection or expert stack "
                              f"(module paths look like {modules[:3]})")
        selected.update(hit)
    by_subpath: dict[str, dict[str, bool]] = {}
    for m in modules:
        prefix, rest = split_layer_prefix(m.split("/"))
        by_subpath.setdefault("/".join(rest), {})["/".join(prefix)] = m in selected
    chosen = set()
    for sub, layers in sorted(by_subpath.items()):
        on = sorted(k for k, v in layers.items() if v)
        if on and len(on) != len(layers):
            off = sorted(k for k, v in layers.items() if not v)
            raise ConfigError(f"config key train.lora.targets selects {sub} in {on[:4]} but not in {off[:4]}: "
                              f"a projection is adapted in every layer that has it (scanned layers share one "
                              f"structure)")
        if on:
            chosen.add(sub)
    alpha = float(s["alpha"]) if s["alpha"] is not None else float(rank)
    return LoraSpec(rank=rank, alpha=alpha, targets=frozenset(chosen), expert_rank=s["expert_rank"],
                    expert_mode=s["expert_mode"])
