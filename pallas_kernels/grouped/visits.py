"""Which (row tile, group) pairs a grouped matmul visits, megablox style.

Rows are sorted by group; the row tiles of tm rows are visited group by group, a tile that
straddles groups once for each group it holds (masked to that group's rows). The rows
past Σ sizes form one more group, E (no weight: its visits write zeros), so every row of
every tile is written; a static number of visits, ceil(M/tm) + E, always suffices (E + 1
groups add at most E straddles), and the visits left over belong to group E + 1, which
holds no rows.

A weight gradient (pallas_kernels.gmm's tgmm) needs the other view: every real group
visited at least once, an empty one too (its visit writes that expert's zero gradient),
and no visit of the rows past Σ sizes, which add to no weight (`every_group=True`). The
same bound holds: the non-empty groups share at most one tile per boundary and each empty
group adds one visit.
"""
from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp


class Visits(NamedTuple):
    group: jnp.ndarray   # [V] int32: 0..E-1 a weight's group, E rows past Σ sizes, E+1 none
    tile: jnp.ndarray    # [V] int32: the row tile visited (nondecreasing)
    weight: jnp.ndarray  # [V] int32: the expert whose weights the visit loads (for E and
    #                      E+1, the last real one: no new weight DMA for a visit that uses none)
    bounds: jnp.ndarray  # [E + 3] int32: group g holds rows [bounds[g], bounds[g + 1])


def n_visits(m_pad: int, tm: int, n_groups: int) -> int:
    return m_pad // tm + n_groups


def visits(group_sizes, m_pad: int, tm: int, *, every_group: bool = False) -> Visits:
    """The visit list for groups of `group_sizes` [E] over m_pad (a multiple of tm) rows
    (`every_group`: the weight-gradient view, see the module doc)."""
    E = group_sizes.shape[0]
    ends = jnp.cumsum(group_sizes.astype(jnp.int32))
    total = jnp.minimum(ends[-1], m_pad)
    ends = jnp.minimum(ends, m_pad)
    starts = jnp.concatenate([jnp.zeros(1, jnp.int32), ends[:-1]])
    g_start = jnp.concatenate([starts, total[None]])          # E real groups, then group E
    g_end = jnp.concatenate([ends, jnp.full((1,), m_pad, jnp.int32)])
    first = g_start // tm
    n_tiles = jnp.where(g_end > g_start, (g_end - 1) // tm - first + 1, 0)
    if every_group:
        n_tiles = jnp.concatenate([jnp.maximum(n_tiles[:E], 1), jnp.zeros(1, n_tiles.dtype)])
    cum = jnp.cumsum(n_tiles)
    V = n_visits(m_pad, tm, E)
    v = jnp.arange(V, dtype=jnp.int32)
    group = jnp.searchsorted(cum, v, side="right").astype(jnp.int32)  # E + 1 past the end
    g = jnp.minimum(group, E)
    tile = jnp.where(group <= E, first[g] + v - (cum[g] - n_tiles[g]), m_pad // tm - 1)
    tile = jnp.minimum(tile, m_pad // tm - 1)   # an empty group at the very end
    weight = jnp.maximum(jax.lax.cummax(jnp.where(group < E, group, -1)), 0)
    bounds = jnp.concatenate([g_start, jnp.full((2,), m_pad, jnp.int32)])
    return Visits(group, tile.astype(jnp.int32), weight.astype(jnp.int32), bounds)
