"""MLA's attention over its cached latents, the cache read once, across the mesh.

`attend_past(qf, stack, index, lengths, dv)` runs pallas_kernels.latent_attention on each
device's share under `shard_map` and merges the shares by their log-sum-exp:
  - sequences over the rules' `batch` axes and heads over `heads`' (as far as they divide),
    as the projections around it leave them;
  - the cache's positions over `length`'s axes (where the cache itself is split), and
    further over every other mesh axis the query rows are replicated on: those devices hold
    the same rows and the same cache, so each reads its own part of the positions (a serving
    layout with 96 heads over 32 devices and a tensor axis of 4 reads a quarter of the
    cache per device instead of all of it). The merge is a max and two sums of the rows'
    [B, T, H, dv] partial outputs over those axes.
`impl(cfg)` says whether a model call takes this path ('pallas') or XLA's two products.
"""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec

from k3jax.config import ModelConfig
from k3jax.mesh import active_mesh_axes, entry_axes, fit_spec
from k3jax.ops.platform import target_backend
from pallas_kernels.latent_attention import past_attention


def impl(cfg: ModelConfig) -> str:
    """'pallas' or 'xla' for the runtime's `decode_attention` ('auto': the kernel on TPU,
    where it is compiled by Mosaic; XLA elsewhere, as the kernel has no GPU form)."""
    choice = cfg.runtime.decode_attention
    if choice == "auto":
        return "pallas" if target_backend() == "tpu" else "xla"
    return choice


def _fit(dim: int, logical: str, sizes: dict) -> tuple[str, ...]:
    axes = active_mesh_axes((logical,))
    return entry_axes(fit_spec((dim,), PartitionSpec(axes or None), sizes)[0]) if axes else ()


def _split_positions(S: int, axes: tuple[str, ...], sizes: dict) -> tuple[str, ...]:
    """The replicated axes that split S evenly into whole kernel blocks (128 positions: the
    kernel's blocks of the position axis, the cache's minor one, are 128-lane multiples)."""
    kept: list[str] = []
    for a in axes:
        n = math.prod(sizes[b] for b in kept) * sizes[a]
        if S % n == 0 and (S // n) % 128 == 0:
            kept.append(a)
    return tuple(kept)


def _merge(o, lse, axes: tuple[str, ...]):
    """Join partial (o, lse) computed over disjoint positions on the devices of `axes`."""
    top = jax.lax.pmax(lse, axes)
    top = jnp.where(jnp.isfinite(top), top, 0.0)
    w = jnp.exp(lse - top)
    den = jax.lax.psum(w, axes)
    num = jax.lax.psum(o * w[..., None], axes)
    seen = den > 0
    return (jnp.where(seen[..., None], num / jnp.where(seen, den, 1.0)[..., None], 0.0),
            jnp.where(seen, top + jnp.log(jnp.where(seen, den, 1.0)), -jnp.inf))


@jax.named_scope("latent_past_attention")
def attend_past(qf, stack, index, lengths, dv: int, *, mode: str = "auto"):
    """qf [B, T, H, E] fp32 (scaled, W_uk folded in); stack [G, B, E, S] the caches of G
    layers, this layer's at `index`; lengths [B]. Returns (o [B, T, H, dv], lse [B, T, H])
    over the cached positions below each row's length (o = 0, lse = -inf where none)."""
    B, T, H, E = qf.shape
    S = stack.shape[3]
    mesh = jax.sharding.get_abstract_mesh()
    sizes = {} if mesh.empty else {a: n for a, n in mesh.shape.items() if n > 1}

    def local(q, cache, lens, idx, pos_axes, split_axes, S_run):
        b, t, h, _ = q.shape
        shard = 0
        for a in pos_axes:                      # linear index over the axes splitting positions
            shard = shard * sizes[a] + jax.lax.axis_index(a)
        n_split = math.prod(sizes[a] for a in split_axes)
        held = cache.shape[3]                  # this device's positions (split over length's axes)
        offset = (shard // n_split) * held
        o, lse = past_attention(q.reshape(b, t * h, E), cache, lens - offset, dv, index=idx,
                                start=(shard % n_split) * S_run, length=S_run, mode=mode)
        o, lse = o.reshape(b, t, h, dv), lse.reshape(b, t, h)
        return _merge(o, lse, pos_axes) if pos_axes else (o, lse)

    if not sizes:
        return local(qf, stack, lengths, index, (), (), S)
    batch = _fit(B, "batch", sizes)
    heads = tuple(a for a in _fit(H, "heads", sizes) if a not in batch)
    length = tuple(a for a in _fit(S, "length", sizes) if a not in batch + heads)
    held = S // math.prod(sizes[a] for a in length)
    spare = tuple(a for a in sizes if a not in batch + heads + length)
    split = _split_positions(held, spare, sizes)
    S_run = held // math.prod(sizes[a] for a in split)
    e = lambda axes: axes[0] if len(axes) == 1 else (axes or None)  # noqa: E731
    fn = jax.shard_map(
        lambda q, c, n, i: local(q, c, n, i, length + split, split, S_run),
        # interpret mode (CPU) cannot run scalar-prefetched index maps over typed operands
        # (jax 0.10; pallas_kernels.gmm's tests say the same): typed where Mosaic runs it
        check_vma=mode == "tpu" or (mode == "auto" and target_backend() == "tpu"),
        in_specs=(PartitionSpec(e(batch), None, e(heads), None), PartitionSpec(None, e(batch), None, e(length)),
                  PartitionSpec(e(batch)), PartitionSpec()),
        out_specs=(PartitionSpec(e(batch), None, e(heads), None), PartitionSpec(e(batch), None, e(heads))))
    return fn(qf, stack, lengths, jnp.asarray(index, jnp.int32))
