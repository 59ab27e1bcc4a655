"""Reduced depths and the extrapolation back to full depth.

K3 is head + n × group + tail (`layout.layer_plan`), the group scanned. A reduced config
keeps the head, the group and the tail and repeats the group fewer times, so every figure
of a compiled step — each memory term, FLOPs, bytes, collective bytes — is a + b·n in the
group count n: the fixed parts (embedding, lm_head, unrolled ends, loss) plus n times one
group's share. Two depths give a and b; `extrapolate` evaluates them at full depth.

One thing would break that: the Block-AttnRes stack's size (one slot per block of
`attn_res_block_size` layers) depends on the depth. A reduced config keeps the full
model's stack size, so the carry every layer saves stays what it is at full depth.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from k3jax.config import ConfigError, ModelConfig


@dataclass(frozen=True)
class ReducedDepthConfig(ModelConfig):
    """A ModelConfig at fewer layers whose AttnRes stack keeps the full model's size."""
    attn_res_blocks: int = 0

    @property
    def max_attn_res_blocks(self) -> int:
        return self.attn_res_blocks if self.use_attn_res else 0


def group_count(cfg: ModelConfig) -> int:
    from k3jax.layout import layer_plan
    return layer_plan(cfg).n_groups


def reduced(cfg: ModelConfig, n_groups: int) -> ModelConfig:
    """`cfg` with its scanned group repeated `n_groups` times (head and tail unchanged)."""
    from k3jax.layout import layer_plan
    plan = layer_plan(cfg)
    if plan.n_groups < 2:
        raise ConfigError(f"{cfg.num_hidden_layers} layers hold no repeated group to reduce")
    if not 2 <= n_groups <= plan.n_groups:
        raise ConfigError(f"reduced depth: n_groups must lie in 2..{plan.n_groups} (a single group is not "
                          f"scanned), got {n_groups}")
    kinds = list(zip(cfg.layer_kinds, cfg.ffn_kinds))
    new = [kinds[i] for i in plan.head] + list(plan.group) * n_groups + [kinds[i] for i in plan.tail]
    fields = {f.name: getattr(cfg, f.name) for f in dataclasses.fields(ModelConfig)}
    fields.update(num_hidden_layers=len(new), hf_extra={}, hf_keys=(),
                  kda_layers=tuple(i + 1 for i, (a, _) in enumerate(new) if a == "kda"),
                  full_attn_layers=tuple(i + 1 for i, (a, _) in enumerate(new) if a == "mla"))
    out = ReducedDepthConfig(**fields, attn_res_blocks=cfg.max_attn_res_blocks)
    got = layer_plan(out)
    if list(zip(out.layer_kinds, out.ffn_kinds)) != new or (len(got.head), got.group, got.n_groups,
                                                             len(got.tail)) != (len(plan.head), plan.group,
                                                                                n_groups, len(plan.tail)):
        raise ConfigError(f"reduced depth {n_groups}: the layer plan does not keep the full model's head, "
                          f"group and tail")
    return out


def extrapolate(n1: int, y1, n2: int, y2, n: int):
    """y at n from the line through (n1, y1) and (n2, y2); numbers or dicts of numbers."""
    if isinstance(y1, dict):
        return {k: extrapolate(n1, y1[k], n2, y2[k], n) for k in y1 if k in y2}
    slope = (y2 - y1) / (n2 - n1)
    return y1 + slope * (n - n1)
