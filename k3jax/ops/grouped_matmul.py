"""Grouped matmul for dropless MoE: rows sorted by expert, each group times its own weight.

`grouped_matmul(x, w, group_sizes)` has `jax.lax.ragged_dot`'s contract. Two forms:
- "pallas" (TPU and GPU): our grouped-matmul kernels (pallas_kernels.gmm) joined by a
  custom VJP: dx is the same kernel through Wᵀ, dW the transposed kernel `tgmm`, which
  multiplies only each expert's own rows. XLA's transpose of `ragged_dot` (what autodiff
  gave before) is a dense product of every row with every local expert: 14× the expert
  weight-gradient FLOPs in K3's compiled train step. Interpret mode on CPU, for tests.
- "tiled" (CPU): XLA:CPU lowers `ragged_dot` itself to that dense product (E× the FLOPs,
  896× for K3), so CPU runs each group padded to whole row tiles, one [tile, D] × [D, F]
  product per tile with its expert's weight (at most one partial tile of padding a
  group), differentiated by autodiff.
"auto" (the default) picks by the backend the program is traced for
(`k3jax.ops.platform.target_backend`): the row tiles for CPU, the kernels otherwise. Not a
`jax.lax.platform_dependent` of the two: that traces the kernels into every CPU program too,
which made tracing the toy's train step 4x slower (6 s to 23 s).

Inside the MoE's `shard_map` (type check on) the inputs are cast to vary together outside
the custom VJP: the weight's cotangent then comes back summed over the token shards its
weight is replicated on, by the cast's own transpose.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from k3jax.ops.platform import target_backend
from pallas_kernels.gmm import gmm, tgmm
from pallas_kernels.grouped.manual import vary_together

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
    """The CPU form (module doc)."""
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


IMPLS = ("auto", "tiled", "pallas")


def grouped_matmul(x, w, group_sizes, *, impl="auto", expected_rows=None):
    """x [M, D] with rows sorted by group, w [E, D, F], group_sizes [E] (Σ <= M; rows past
    the sum come out zero). Returns [M, F] in the operands' result type: row r times the
    weight of its group. impl: see the module doc ("pallas" runs the kernels on every
    platform: Mosaic on TPU, Triton on GPU, interpret mode elsewhere).
    expected_rows: the rows doing real work under balanced routing, for the kernels'
    declared costs (pallas_kernels.gmm)."""
    if impl not in IMPLS:
        raise ValueError(f"grouped_matmul: unknown impl {impl!r}; expected one of {IMPLS}")
    dt = jnp.result_type(x, w)
    x, w = x.astype(dt), w.astype(dt)
    group_sizes = jnp.asarray(group_sizes, jnp.int32)
    tiled = functools.partial(_tiled, tile=tile_rows(x.shape[0], w.shape[0]))
    if x.shape[0] == 0 or impl == "tiled":
        return tiled(x, w, group_sizes)
    if impl == "auto" and target_backend() == "cpu":
        return tiled(x, w, group_sizes)
    return _typed(expected_rows, x, w, group_sizes)


# -- the kernels' differentiable op -----------------------------------------------------


def _typed(expected, x, w, sizes):
    return _pallas(expected, *vary_together(x, w, sizes)[0])


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _pallas(expected, x, w, sizes):
    return gmm(x, w, sizes, expected_rows=expected)


def _pallas_fwd(expected, x, w, sizes):
    return _pallas(expected, x, w, sizes), (x, w, sizes)


def _pallas_bwd(expected, res, ct):
    x, w, sizes = res
    ct = ct.astype(x.dtype)
    dx = gmm(ct, w, sizes, transpose_rhs=True, expected_rows=expected)
    dw = tgmm(x, ct, sizes, out_dtype=w.dtype, expected_rows=expected)
    return dx, dw, np.zeros(sizes.shape, jax.dtypes.float0)


_pallas.defvjp(_pallas_fwd, _pallas_bwd)
