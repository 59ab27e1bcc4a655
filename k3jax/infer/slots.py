"""The compiled steps of the serving engine over a fixed set of cache slots.

One cache of `slots` rows and `max_len` tokens lives for the engine's life. A step feeds
every slot at once, [slots, width] tokens with `n_new` real ones per row: a prefilling
slot its next chunk of prompt, a decoding slot its last sampled token, an idle slot
nothing (n_new = 0 leaves its KDA state, conv tails and latents as they were). Widths are
two, the chunk and 1, so the whole engine compiles the model twice per mesh.

A slot is (re)started by writing a one-row cache into it: a blank one, or a saved prefix
(stale latents beyond a row's length are never read: attention masks at `lengths`).
"""
from __future__ import annotations

import functools

import jax

from k3jax.infer.caches import Cache, apply_updates, cache_shardings
from k3jax.infer.generate import _run
from k3jax.infer.sampling import sample_rows
from k3jax.layout import stacked_axes


@functools.partial(jax.jit, static_argnums=0, donate_argnums=2)
def step(cfg, params, cache: Cache, tokens, n_new, seeds, counts, temperature, top_k, top_p):
    """(sampled ids [S], logits [S, V] at each row's last real token, cache). Rows whose
    prompt is not yet all fed ignore their sample."""
    logits, updates = _run(cfg, params, cache.layers, cache.lengths, tokens, n_new)
    cache = _keep_layout(apply_updates(cache, updates, n_new))
    return sample_rows(logits, seeds, counts, temperature, top_k, top_p), logits, cache


def _keep_layout(cache: Cache) -> Cache:
    """Under a mesh, the updated cache laid out as the engine placed it
    (caches.cache_shardings): left to XLA, a prefill chunk's output cache came out split
    fewer ways than its input (K3 on v5p-1024: 13.5 GiB a device instead of 0.5), so it
    could not reuse the donated buffer and the next step would compile for a new layout."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty:
        return cache
    from flax import linen as nn
    return jax.lax.with_sharding_constraint(cache, cache_shardings(cache, mesh, nn.get_logical_axis_rules()))


@functools.partial(jax.jit, donate_argnums=0)
def put_row(cache: Cache, row_cache: Cache, row) -> Cache:
    """`cache` with slot `row` replaced by the one-row `row_cache` (same max_len)."""
    def put(path, big, one):
        return jax.lax.dynamic_update_slice_in_dim(big, one.astype(big.dtype), row, axis=stacked_axes(path))
    layers = jax.tree_util.tree_map_with_path(put, cache.layers, row_cache.layers)
    return Cache(layers, jax.lax.dynamic_update_slice(cache.lengths, row_cache.lengths, (row,)))


@jax.jit
def take_row(cache: Cache, row) -> Cache:
    """A one-row copy of slot `row` (a prefix snapshot later steps cannot overwrite)."""
    def take(path, big):
        return jax.lax.dynamic_slice_in_dim(big, row, 1, axis=stacked_axes(path))
    layers = jax.tree_util.tree_map_with_path(take, cache.layers)
    return Cache(layers, jax.lax.dynamic_slice(cache.lengths, (row,), (1,)))
