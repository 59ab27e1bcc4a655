"""The layer plan and the param-path conventions of the k3jax tree, in one place.

Decoder layer i lives at `layers_{i}` when it is unrolled, or at `groups/sub_{j}` (slot j of
the scanned group, stacked on a leading `layers` axis) when it repeats (`layer_plan`).
Everything that builds such a path or needs "which layer, which module" from one (the
model, checkpoint names, caches, optimizer groups) asks here instead of spelling it.
"""
from __future__ import annotations

import functools
import re
from dataclasses import dataclass

from k3jax.config import ModelConfig

GROUPS = "groups"     # the scanned layer groups' subtree

_UNROLLED = re.compile(r"layers_(\d+)$")
_SLOT = re.compile(r"sub_(\d+)$")


@dataclass(frozen=True)
class LayerPlan:
    """head (unrolled) + n_groups × group (scanned) + tail (unrolled), 0-based indices."""
    head: tuple[int, ...]
    group: tuple[tuple[str, str], ...]      # (attention kind, ffn kind) per layer in a group
    group_start: int
    n_groups: int
    tail: tuple[int, ...]

    @property
    def group_size(self) -> int:
        return len(self.group)


@functools.lru_cache(maxsize=64)   # asked once per param path by Muon's groups and the planner
def layer_plan(cfg: ModelConfig, max_period: int = 8) -> LayerPlan:
    """The longest run of ≥ 2 identical consecutive layer groups. Ties prefer groups that
    close on full attention (K3's [KDA, KDA, KDA, MLA]), then shorter periods."""
    kinds = list(zip(cfg.layer_kinds, cfg.ffn_kinds))
    L = len(kinds)
    best_key, best = None, None
    for p in range(1, min(max_period, L // 2) + 1) if cfg.runtime.scan_layers else ():
        for start in range(L - 2 * p + 1):
            group = kinds[start:start + p]
            n = 1
            while start + (n + 1) * p <= L and kinds[start + n * p:start + (n + 1) * p] == group:
                n += 1
            key = (n * p, group[-1][0] == "mla", -p, -start)
            if n >= 2 and (best_key is None or key > best_key):
                best_key, best = key, (p, start, n)
    if best is None:
        return LayerPlan(tuple(range(L)), (), L, 0, ())
    p, start, n = best
    return LayerPlan(tuple(range(start)), tuple(kinds[start:start + p]), start, n,
                     tuple(range(start + n * p, L)))


def slot_pushes(cfg: ModelConfig, plan: LayerPlan) -> tuple[bool, ...]:
    """Per slot of the scanned group: whether any group's layer there starts an AttnRes block."""
    if not cfg.use_attn_res:
        return (False,) * plan.group_size
    bs = cfg.attn_res_block_size
    return tuple(any((plan.group_start + g * plan.group_size + j) % bs == 0 for g in range(plan.n_groups))
                 for j in range(plan.group_size))


def unrolled_name(layer: int) -> str:
    """The subtree name of unrolled decoder layer `layer` (0-based)."""
    return f"layers_{layer}"


def slot_name(slot: int) -> str:
    """The subtree name, under GROUPS, of slot `slot` of the scanned group."""
    return f"sub_{slot}"


def layer_location(plan: LayerPlan, layer: int) -> tuple[tuple[str, ...], tuple[int, ...]]:
    """Tree prefix and index along the stacked `layers` axis of 0-based decoder layer `layer`."""
    off = layer - plan.group_start
    if plan.n_groups and 0 <= off < plan.n_groups * plan.group_size:
        return (GROUPS, slot_name(off % plan.group_size)), (off // plan.group_size,)
    return (unrolled_name(layer),), ()


def attention_kind(cfg: ModelConfig, parts) -> str | None:
    """'kda' / 'mla' of the decoder layer a path lies in; None outside the layers."""
    prefix, _ = split_layer_prefix(parts)
    if len(prefix) == 1:
        return cfg.layer_kinds[int(_UNROLLED.match(prefix[0]).group(1))]
    if len(prefix) == 2:
        return layer_plan(cfg).group[int(_SLOT.match(prefix[1]).group(1))][0]
    return None


def stacked_axes(parts) -> int:
    """Leading axes a leaf at this path has before its own: 1 (the scanned `layers` axis)
    in the scanned groups, else 0. Paths are name sequences, or jax key paths."""
    names = [getattr(k, "key", k) for k in parts]
    return 1 if names and names[0] == GROUPS else 0


def split_layer_prefix(parts) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """(layer prefix, the rest) of a path given as a sequence of names: ('layers_3',) or
    ('groups', 'sub_1'), or () for params outside the decoder layers (and for the bare
    module paths a lone DecoderLayer sees)."""
    parts = tuple(parts)
    if parts and _UNROLLED.match(parts[0]):
        return parts[:1], parts[1:]
    if len(parts) > 1 and parts[0] == GROUPS and _SLOT.match(parts[1]):
        return parts[:2], parts[2:]
    return (), parts


def layer_subpath(parts) -> str:
    """The path inside a decoder layer, '/'-joined: 'self_attn/q_proj' for
    ('groups', 'sub_0', 'self_attn', 'q_proj') and for ('self_attn', 'q_proj') alike."""
    return "/".join(split_layer_prefix(parts)[1])


def is_scanned(parts) -> bool:
    """Whether a path lies in the scanned groups (leaves stacked on a leading layers axis)."""
    return len(split_layer_prefix(parts)[0]) == 2
