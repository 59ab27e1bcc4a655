"""Decode caches as pytrees laid out like the params.

`Cache.layers` has one entry per decoder layer under the layer's param name
(`layers_0`, ..., and `groups/sub_j` stacked on a leading axis for the scanned groups,
exactly like the params, so the cache rides through the same `nn.scan`):
  KDA layer: `q_conv`, `k_conv`, `v_conv` [B, W-1, H*K] (the last W-1 conv inputs, compute
             dtype) and `state` [B, H, K, V] fp32 — constant size, whatever the context;
  MLA layer: `kv` [B, kv_lora + rope, max_len] — normalised c then k_r per token, in a
             preallocated buffer, valid below `lengths`. Feature-major, positions minor:
             TPU lays a [.., max_len, 576] buffer out with the positions minor anyway (576
             is not a multiple of 128 lanes), and the fused decode attention
             (pallas_kernels.latent_attention) reads row-major blocks, so stored this way
             what the kernel reads is what the compiler stores: no relayout of the cache.
Block AttnRes mixes over depth per token, so nothing of it is cached across time.
`lengths` [B] int32 counts the tokens cached per row (rows may differ).
"""
from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from k3jax.config import ModelConfig
from k3jax.layers.common import compute_dtype
from k3jax.layout import GROUPS, layer_plan, slot_name, stacked_axes, unrolled_name


class Cache(NamedTuple):
    layers: dict
    lengths: jax.Array

    @property
    def max_len(self) -> int:
        """Token capacity of the MLA buffers (unbounded for KDA-only models: None)."""
        for leaf_path, leaf in jax.tree_util.tree_leaves_with_path(self.layers):
            if getattr(leaf_path[-1], "key", None) == "kv":
                return leaf.shape[-1]
        return None


def _layer_cache(cfg: ModelConfig, kind: str, batch: int, max_len: int, lead: tuple[int, ...]):
    H, K, W = cfg.kda_num_heads, cfg.kda_head_dim, cfg.short_conv_kernel_size
    dt = compute_dtype(cfg)
    if kind == "kda":
        # three distinct buffers: a donated cache may not hold one buffer twice
        tails = {f"{n}_conv": jnp.zeros(lead + (batch, W - 1, H * K), dt) for n in "qkv"}
        return {**tails,
                "state": jnp.zeros(lead + (batch, H, K, K), jnp.float32)}
    return {"kv": jnp.zeros(lead + (batch, cfg.mla_cache_dim, max_len), dt)}


def init_cache(cfg: ModelConfig, batch: int, max_len: int) -> Cache:
    """An empty cache for `batch` sequences of up to `max_len` tokens (MLA buffers)."""
    plan = layer_plan(cfg)
    layers = {unrolled_name(i): _layer_cache(cfg, cfg.layer_kinds[i], batch, max_len, ())
              for i in plan.head + plan.tail}
    if plan.n_groups:
        layers[GROUPS] = {slot_name(j): _layer_cache(cfg, kind, batch, max_len, (plan.n_groups,))
                            for j, (kind, _) in enumerate(plan.group)}
    return Cache(layers, jnp.zeros((batch,), jnp.int32))


def cache_shardings(cache: Cache, mesh, rules) -> Cache:
    """NamedShardings that lay an engine's `cache` out on `mesh` (a training run's rollouts,
    a served mesh): every leaf's rows over the rules' `batch` axes whose product is the
    largest that divides the row count (mesh.row_axes), and a KDA layer's heads (state
    [.., B, H, K, V], conv tails [.., B, W-1, H*K]) over the `heads` axes the rows leave, as
    far as they divide (mesh.fit_spec); the rest replicated. Row counts are small (slots):
    rows over a prefix of the batch axes alone would copy the caches over most of a pod."""
    from flax import linen as nn
    from jax.sharding import NamedSharding, PartitionSpec as P

    from k3jax.mesh import entry_axes, fit_spec, row_axes
    sizes = dict(mesh.shape)
    batch_entry, heads_entry = nn.logical_to_mesh_axes(("batch", "heads"), rules)

    def spec(shape, lead: int, heads_dim: int | None):
        out = [None] * len(shape)
        rows = row_axes(shape[lead], batch_entry, sizes)
        out[lead] = rows[0] if len(rows) == 1 else rows or None
        if heads_dim is not None:
            free = tuple(a for a in entry_axes(heads_entry) if a not in rows and sizes[a] > 1)
            out[lead + heads_dim] = fit_spec((shape[lead + heads_dim],), P(free or None), sizes)[0]
        return NamedSharding(mesh, P(*out))

    def one(path, x):
        name = getattr(path[-1], "key", None)
        return spec(x.shape, stacked_axes(path), {"state": 1, "kv": None}.get(name, 2))

    layers = jax.tree_util.tree_map_with_path(one, cache.layers)
    return Cache(layers, NamedSharding(mesh, P()))


def empty_past(cache: Cache) -> dict:
    """The cache as a fresh prefill sees it: zero KDA state and no earlier latents (the
    MLA buffers cut to length 0, so prefill attends only among its own tokens)."""
    def cut(path, x):
        return x[..., :0] if getattr(path[-1], "key", None) == "kv" else x
    return jax.tree_util.tree_map_with_path(cut, cache.layers)


def apply_updates(cache: Cache, updates: dict, n_new) -> Cache:
    """Fold one model call's updates into the cache: KDA entries are replaced, MLA latents
    [.., B, T, E] are written into the [.., B, E, S] buffers at each row's positions
    lengths[b] + t for t < n_new[b] (padding is dropped, never written)."""
    B = cache.lengths.shape[0]

    def merge(path, old, new):
        if getattr(path[-1], "key", None) != "kv":
            return new
        T, S = new.shape[-2], old.shape[-1]
        if T == 1:
            return _write_one_token(old, new, cache.lengths, n_new)
        t = jnp.arange(T)[None, :]
        pos = jnp.where(t < n_new[:, None], cache.lengths[:, None] + t, S)  # S: out of range, dropped
        rows = jnp.broadcast_to(jnp.arange(B)[:, None], (B, T))
        # indices split by a slice: the indexed dims come first ([B, T, (G,) E])
        if old.ndim == 3:
            return old.at[rows, :, pos].set(new.astype(old.dtype), mode="drop")
        return old.at[:, rows, :, pos].set(jnp.moveaxis(new, 0, 2).astype(old.dtype), mode="drop")

    layers = jax.tree_util.tree_map_with_path(merge, cache.layers, updates)
    return Cache(layers, cache.lengths + n_new.astype(cache.lengths.dtype))


def _write_one_token(old, new, lengths, n_new):
    """A decode step's latents [.., B, 1, E] written at lengths[b] of [.., B, E, S], one
    in-place update per row. Each row rewrites the aligned window of up to 128 positions around its slot (the
    new column selected in, the rest written back as read): a one-column update [.., E, 1]
    made XLA's TPU layout pass re-lay the whole cache out E-minor and back around the write
    (0.6 GB per MLA layer per chip, K3 at 32 sequences), while a [.., E, 128] window tiles like
    the S-minor cache itself and stays in place. A full row (lengths[b] = S) or no new token
    (n_new[b] = 0) writes back what is there. A Python loop, not a fori_loop: the loop form
    compiled to 1.75 GiB more temporaries per chip for the same step."""
    S = old.shape[-1]
    w = min(128, S)
    lead = old.ndim - 3                                   # 1 for the scanned groups' stacks
    slot = jnp.arange(w)
    for b in range(lengths.shape[0]):
        pos = jnp.minimum(lengths[b], S - 1)
        start = jnp.minimum(pos // w * w, S - w)
        at = (0,) * lead + (b, 0, start)
        size = old.shape[:lead] + (1, old.shape[-2], w)
        here = jax.lax.dynamic_slice(old, at, size)
        fresh = jnp.swapaxes(jax.lax.dynamic_slice_in_dim(new, b, 1, axis=lead), -1, -2).astype(old.dtype)
        keep = (slot == pos - start) & (lengths[b] < S) & (n_new[b] > 0)
        old = jax.lax.dynamic_update_slice(old, jnp.where(keep, fresh, here), at)
    return old


def copy_cache(cache: Cache) -> Cache:
    """A snapshot that later in-place (donated) decode steps cannot overwrite."""
    return jax.tree.map(lambda x: jnp.array(x, copy=True), cache)


def select_rows(cache: Cache, rows) -> Cache:
    """The cache of the given batch rows (e.g. to save one sequence's prefix)."""
    rows = jnp.asarray(rows)
    layers = jax.tree_util.tree_map_with_path(lambda p, x: jnp.take(x, rows, axis=stacked_axes(p)), cache.layers)
    return Cache(layers, cache.lengths[rows])


def cache_bytes(cache) -> int:
    return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(cache))


def spec_bytes_per_token(cfg: ModelConfig) -> int:
    """SPEC §4: each MLA layer caches kv_lora + rope values per token (576 for K3);
    KDA layers add nothing per token."""
    return cfg.layer_kinds.count("mla") * cfg.mla_cache_dim * compute_dtype(cfg).itemsize


def spec_bytes_per_sequence(cfg: ModelConfig) -> int:
    """SPEC §3: per KDA layer the fp32 state H·K·V and three conv tails of W-1 inputs."""
    H, K, W = cfg.kda_num_heads, cfg.kda_head_dim, cfg.short_conv_kernel_size
    per = H * K * K * 4 + 3 * (W - 1) * H * K * compute_dtype(cfg).itemsize
    return cfg.layer_kinds.count("kda") * per


def resize(cache: Cache, max_len: int) -> Cache:
    """The same cache with MLA buffers of `max_len` tokens (grown with zeros, or cut —
    never below what is cached). KDA entries do not depend on length."""
    def fit(path, x):
        if getattr(path[-1], "key", None) != "kv":
            return x
        S = x.shape[-1]
        if max_len >= S:
            pad = [(0, 0)] * x.ndim
            pad[-1] = (0, max_len - S)
            return jnp.pad(x, pad)
        return x[..., :max_len]
    if cache.max_len is not None and max_len < int(jnp.max(cache.lengths)):
        raise ValueError(f"cannot cut a cache holding {int(jnp.max(cache.lengths))} tokens to max_len={max_len}")
    return Cache(jax.tree_util.tree_map_with_path(fit, cache.layers), cache.lengths)
