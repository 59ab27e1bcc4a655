"""Grouped matmul for dropless MoE: rows sorted by expert, each group times its own weight.

`grouped_matmul(x, w, group_sizes)` has `jax.lax.ragged_dot`'s contract. TPU and GPU run
`ragged_dot` itself; XLA:CPU lowers `ragged_dot` to a dense product of every row with
every expert's weight, masked afterwards (E× the FLOPs: 896× for K3), so CPU gets a tiled
form instead — each group padded to whole row tiles, one [tile, D] × [D, F] product per
tile with that tile's expert weight, padding at most one partial tile per group.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

_HI = jax.lax.Precision.HIGHEST
_MAX_TILE = 128


def tile_rows(m: int, n_groups: int) -> int:
    """Rows per tile: a power of two in [8, 128] with n_groups · tile <= max(m, 8), so the
    per-group padding never more than doubles the work."""
    t = 8
    while t * 2 <= _MAX_TILE and n_groups * t * 2 <= m:
        t *= 2
    return t


def _tiled(x, w, group_sizes, tile):
    M, D = x.shape
    E, _, F = w.shape
    n_tiles = -(-M // tile) + E  # static bound: each group adds at most one partial tile
    sizes = group_sizes.astype(jnp.int32)
    tiles = (sizes + tile - 1) // tile
    tile_end = jnp.cumsum(tiles)
    tile_start = tile_end - tiles
    row_end = jnp.cumsum(sizes)
    row_start = row_end - sizes

    # Tile i belongs to group tile_group[i] (E: an unused tile past the last group).
    tile_group = jnp.searchsorted(tile_end, jnp.arange(n_tiles), side="right")
    g = jnp.minimum(tile_group, E - 1)
    local = (jnp.arange(n_tiles) - tile_start[g])[:, None] * tile + jnp.arange(tile)[None, :]
    valid = (tile_group < E)[:, None] & (local < sizes[g][:, None])
    src = jnp.where(valid, row_start[g][:, None] + local, M)  # row M: a zero row
    x_tiles = jnp.concatenate([x, jnp.zeros((1, D), x.dtype)])[src]  # [n_tiles, tile, D]

    # Rematerialised so the backward re-slices each tile's weight instead of keeping an
    # [n_tiles, D, F] stack of them.
    @jax.checkpoint
    def one_tile(x_tile, e):
        w_e = jax.lax.dynamic_index_in_dim(w, e, keepdims=False)
        return jnp.dot(x_tile, w_e, precision=_HI, preferred_element_type=jnp.float32)

    _, y = jax.lax.scan(lambda c, xs: (c, one_tile(*xs)), None, (x_tiles, g))  # [n_tiles, tile, F]

    # Row r sits in group grp[r] at padded position tile_start·tile + (r − row_start).
    r = jnp.arange(M)
    grp = jnp.minimum(jnp.searchsorted(row_end, r, side="right"), E - 1)
    pos = tile_start[grp] * tile + (r - row_start[grp])
    out = y.reshape(-1, F)[jnp.minimum(pos, n_tiles * tile - 1)]
    return jnp.where((r < row_end[-1])[:, None], out, 0.0).astype(jnp.result_type(x, w))


def grouped_matmul(x, w, group_sizes):
    """x [M, D] with rows sorted by group, w [E, D, F], group_sizes [E] (Σ <= M; rows past
    the sum come out zero). Returns [M, F]: row r times the weight of its group."""
    tile = tile_rows(x.shape[0], w.shape[0])
    # HIGHEST only where it means something (fp32 operands): bf16 products are exact in one
    # bf16 pass, and TPU's ragged_dot kernel (Mosaic) refuses bf16 operands at fp32
    # contract precision ("Bad lhs type"; found by compiling the train step for v5p)
    prec = _HI if jnp.result_type(x, w) == jnp.float32 else None
    return jax.lax.platform_dependent(
        x, w, group_sizes,
        cpu=lambda x, w, s: _tiled(x, w, s, tile),
        default=lambda x, w, s: jax.lax.ragged_dot(x, w, s, precision=prec),
    )
