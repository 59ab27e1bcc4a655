"""Param-path conventions of the k3jax tree, in one place.

Decoder layer i lives at `layers_{i}` when it is unrolled, or at `groups/sub_{j}` (slot j of
the scanned group, stacked on a leading `layers` axis) when it repeats. Everything that
needs to know "which layer, which module" from a path asks here instead of parsing paths.
"""
from __future__ import annotations

import re

_UNROLLED = re.compile(r"layers_(\d+)$")
_SLOT = re.compile(r"sub_(\d+)$")


def split_layer_prefix(parts) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """(layer prefix, the rest) of a path given as a sequence of names: ('layers_3',) or
    ('groups', 'sub_1'), or () for params outside the decoder layers (and for the bare
    module paths a lone DecoderLayer sees)."""
    parts = tuple(parts)
    if parts and _UNROLLED.match(parts[0]):
        return parts[:1], parts[1:]
    if len(parts) > 1 and parts[0] == "groups" and _SLOT.match(parts[1]):
        return parts[:2], parts[2:]
    return (), parts


def layer_subpath(parts) -> str:
    """The path inside a decoder layer, '/'-joined: 'self_attn/q_proj' for
    ('groups', 'sub_0', 'self_attn', 'q_proj') and for ('self_attn', 'q_proj') alike."""
    return "/".join(split_layer_prefix(parts)[1])


def is_scanned(parts) -> bool:
    """Whether a path lies in the scanned groups (leaves stacked on a leading layers axis)."""
    return len(split_layer_prefix(parts)[0]) == 2
