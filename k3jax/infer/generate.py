"""Prefill, cached decode and the generation loop.

Batches hold prompts of different lengths right-padded, with per-row real lengths:
padding gets KDA g = 0 and β = 0 (no decay, no update), conv tails are taken at each
row's own last real token, MLA latents of padding are never written and new tokens
attend causally, so a padded row computes exactly what it would alone. Each row then
decodes at its own position (`Cache.lengths`).

Compiled functions take the config as a static argument: prefill compiles once per
(batch, prompt length, max_len), decode once per (batch, max_len). Decode and extend
donate the cache they are given (in-place buffer updates): keep using the returned one,
and snapshot with `caches.copy_cache` what must survive.
"""
from __future__ import annotations

import functools
from typing import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from k3jax.config import ModelConfig, VisionConfig
from k3jax.infer.caches import Cache, apply_updates, empty_past, init_cache
from k3jax.infer.sampling import SamplingParams, sample, step_key
from k3jax.errors import InputError
from k3jax.model import K3Model, validate_inputs, variables_of
from k3jax.ops.moe_dispatch import for_inference


def _run(cfg, params, past_layers, lengths, tokens, n_new, features=None, rows=None):
    cfg = for_inference(cfg, tokens.size)
    return K3Model(cfg).apply(variables_of(params), tokens, cache=past_layers, pos=(lengths, n_new),
                              image_features=features, feature_rows=rows)


# `features`/`rows` default to None, an empty pytree: the text-only calls trace and compile
# exactly as without images.
@functools.partial(jax.jit, static_argnums=(0, 4))
def _prefill_jit(cfg, params, tokens, n_new, max_len, features=None, rows=None):
    cache = init_cache(cfg, tokens.shape[0], max_len)
    logits, updates = _run(cfg, params, empty_past(cache), cache.lengths, tokens, n_new, features, rows)
    return logits, apply_updates(cache, updates, n_new)


@functools.partial(jax.jit, static_argnums=0, donate_argnums=2)
def _extend_jit(cfg, params, cache, tokens, n_new, features=None, rows=None):
    logits, updates = _run(cfg, params, cache.layers, cache.lengths, tokens, n_new, features, rows)
    return logits, apply_updates(cache, updates, n_new)


# The two compiled steps by public names: `k3jax compile` lowers these same functions.
prefill_step, extend_step = _prefill_jit, _extend_jit


def _as_batch(tokens, lengths):
    tokens = np.asarray(tokens)
    if tokens.ndim == 1:
        tokens = tokens[None]
    if tokens.ndim != 2 or tokens.shape[1] == 0:
        raise InputError(f"tokens must be [batch, length>0] ids, got shape {tokens.shape}")
    T = tokens.shape[1]
    i32 = np.iinfo(np.int32)
    if np.issubdtype(tokens.dtype, np.integer) and (tokens.min() < i32.min or tokens.max() > i32.max):
        # checked before the int32 cast below, which would wrap 2**32 + 5 to 5
        bad = tokens.min() if tokens.min() < i32.min else tokens.max()
        raise InputError(f"token id {int(bad)} is outside the vocabulary")
    n = np.full((tokens.shape[0],), T, np.int32) if lengths is None else np.asarray(lengths, np.int32)
    if n.shape != (tokens.shape[0],) or n.min() < 1 or n.max() > T:
        raise InputError(f"lengths {n.tolist()} must give 1..{T} real tokens for each of {tokens.shape[0]} rows")
    return tokens.astype(np.int32), n


def _check_room(cfg: ModelConfig, cache_len: int | None, end: int):
    if end > cfg.max_position_embeddings:
        raise InputError(f"sequence length {end} exceeds max_position_embeddings={cfg.max_position_embeddings}")
    if cache_len is not None and end > cache_len:
        raise InputError(f"sequence length {end} exceeds the cache's max_len={cache_len}")


def prefill(cfg: ModelConfig, params, tokens, lengths=None, *, max_len: int | None = None,
            chunk: int | None = None, image_features=None, feature_rows=None):
    """Run prompts [B, T] (right-padded; `lengths` [B] real tokens per row, default T)
    from empty caches with room for `max_len` tokens per row (default T).

    `chunk` splits long prompts into pieces of that many tokens (bounded attention
    memory; the first piece is a fresh prefill, the rest extend it). Images: projector
    rows `image_features` [N, D] and `feature_rows` [B, T] (the row each position takes,
    −1 for text; `k3jax.model.multimodal.feature_rows`), sliced per piece alongside the tokens.
    Returns (logits [B, V] fp32 at each row's last real token, cache).
    """
    tokens, n = _as_batch(tokens, lengths)
    validate_inputs(cfg, tokens)
    rows = None
    if image_features is not None:
        rows = np.asarray(feature_rows, np.int32).reshape(tokens.shape)
        if rows.max(initial=-1) >= image_features.shape[0]:
            raise InputError(f"feature_rows point at row {rows.max()} of {image_features.shape[0]} image features")
    max_len = tokens.shape[1] if max_len is None else int(max_len)
    _check_room(cfg, max_len, int(n.max()))
    first = tokens.shape[1] if chunk is None else min(chunk, tokens.shape[1])
    img = () if rows is None else (image_features, jnp.asarray(rows[:, :first]))
    logits, cache = _prefill_jit(cfg, params, jnp.asarray(tokens[:, :first]),
                                 jnp.asarray(np.minimum(n, first)), max_len, *img)
    if first < tokens.shape[1]:
        rest = None if rows is None else (image_features, rows[:, first:])
        logits, cache = _extend_chunks(cfg, params, cache, logits, tokens[:, first:], n - first, chunk, rest)
    return logits, cache


def extend(cfg: ModelConfig, params, cache: Cache, tokens, lengths=None, *, chunk: int | None = None):
    """Continue cached sequences by tokens [B, T] (right-padded, `lengths` real tokens per
    row): the suffix prefill of prefix reuse, and decode when T = 1. Consumes `cache`."""
    tokens, n = _as_batch(tokens, lengths)
    validate_inputs(cfg, tokens)
    if tokens.shape[0] != cache.lengths.shape[0]:
        raise InputError(f"{tokens.shape[0]} rows of tokens for a cache of {cache.lengths.shape[0]} rows")
    _check_room(cfg, cache.max_len, int((np.asarray(cache.lengths) + n).max()))
    logits = jnp.zeros((tokens.shape[0], cfg.vocab_size), jnp.float32)
    return _extend_chunks(cfg, params, cache, logits, tokens, n, chunk or tokens.shape[1])


def _extend_chunks(cfg, params, cache, logits, tokens, n, chunk, images=None):
    # every piece as wide as the first (padding counts as no token): one compile for all
    tokens = np.pad(tokens, [(0, 0), (0, -tokens.shape[1] % chunk)])
    if images is not None:
        feats, rows = images
        rows = np.pad(rows, [(0, 0), (0, tokens.shape[1] - rows.shape[1])], constant_values=-1)
    for s in range(0, tokens.shape[1], chunk):
        n_c = np.clip(n - s, 0, chunk).astype(np.int32)
        img = () if images is None else (feats, jnp.asarray(rows[:, s:s + chunk]))
        new, cache = _extend_jit(cfg, params, cache, jnp.asarray(tokens[:, s:s + chunk]), jnp.asarray(n_c), *img)
        # a row that ended in an earlier piece keeps that piece's logits
        logits = jnp.where(jnp.asarray(n_c > 0)[:, None], new, logits)
    return logits, cache


def decode(cfg: ModelConfig, params, cache: Cache, tokens):
    """One token per row (tokens [B] or [B, 1]) → (logits [B, V], cache). Consumes `cache`."""
    tokens = np.asarray(tokens).reshape(-1, 1)
    return extend(cfg, params, cache, tokens)


def generate(cfg: ModelConfig, params, prompts: Sequence[Sequence[int]], max_new_tokens: int,
             sampling: SamplingParams = SamplingParams(), *, eos_id: int | None = None,
             on_tokens: Callable[[int, np.ndarray], None] | None = None,
             prefix_cache=None, max_len: int | None = None, image_features=None,
             media_pad_id: int | None = None) -> list[list[int]]:
    """Generate up to `max_new_tokens` per prompt (prompts may differ in length).

    Rows stop at `eos_id` (kept in the output); `on_tokens(step, ids [B])` sees every
    step's sampled ids as they come (streaming). With a `PrefixCache` (batch of one), the
    longest saved prefix of the prompt is restored and only the rest is prefilled, and
    the prompt's own cache is saved for later requests.

    `image_features` [N, D]: the prompts' `<|media_pad|>` (`media_pad_id`) tokens, already
    expanded to N in all (`generate_with_images` does that), take
    these rows in order during prefill.
    """
    if max_new_tokens < 1:
        raise InputError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    prompts = [list(map(int, p)) for p in prompts]
    if not prompts or min(map(len, prompts)) < 1:
        raise InputError("every prompt needs at least one token")
    bad = [(b, i, x) for b, p in enumerate(prompts) for i, x in enumerate(p) if not 0 <= x < cfg.vocab_size]
    if bad:
        b, i, x = bad[0]
        raise InputError(f"prompt {b}, position {i}: token id {x} is outside the vocabulary [0, {cfg.vocab_size})")
    n = np.array([len(p) for p in prompts], np.int32)
    need = int(n.max()) + max_new_tokens - 1    # the last sampled token is never fed back
    _check_room(cfg, max_len, need)
    if max_len is None:  # buckets of 64: nearby request sizes share one compiled decode
        max_len = min(-(-need // 64) * 64, cfg.max_position_embeddings)
    if image_features is not None and media_pad_id is None:
        raise InputError("image_features need the media_pad_id whose tokens they replace")
    if image_features is not None and prefix_cache is not None:
        # every image's pads are the same ids: a saved prefix could hold another image
        raise InputError("prefix reuse keys caches by token ids and cannot tell images apart; "
                         "generate with images without a prefix cache")
    if prefix_cache is not None:
        if len(prompts) != 1:
            raise InputError("prefix reuse runs one prompt at a time")
        logits, cache = prefix_cache.prefill(cfg, params, prompts[0], max_len=max_len)
    else:
        pad = cfg.pad_token_id if cfg.pad_token_id is not None and cfg.pad_token_id < cfg.vocab_size else 0
        tokens = np.full((len(prompts), int(n.max())), pad, np.int32)
        for b, p in enumerate(prompts):
            tokens[b, :len(p)] = p
        img = {}
        if image_features is not None:
            from k3jax.model.multimodal import check_media_rows, feature_rows
            valid = np.arange(tokens.shape[1])[None] < n[:, None]
            check_media_rows(tokens, media_pad_id, image_features.shape[0], valid)
            img = {"image_features": image_features, "feature_rows": feature_rows(tokens, media_pad_id, valid)}
        logits, cache = prefill(cfg, params, tokens, n, max_len=max_len, **img)

    out = [[] for _ in prompts]
    done = np.zeros(len(prompts), bool)
    ones = jnp.ones((len(prompts),), jnp.int32)
    kw = dict(temperature=float(sampling.temperature), top_k=int(sampling.top_k), top_p=float(sampling.top_p))
    for step in range(max_new_tokens):
        tok = sample(logits, step_key(sampling.seed, step), **kw)
        ids = np.asarray(tok)
        for b in np.flatnonzero(~done):
            out[b].append(int(ids[b]))
        if on_tokens is not None:
            on_tokens(step, np.where(done, -1, ids))
        if eos_id is not None:
            done |= ids == eos_id
        if done.all() or step == max_new_tokens - 1:
            break
        # inputs were validated up front and sampled ids lie in the vocabulary: the raw
        # compiled step avoids a host round trip per token
        logits, cache = _extend_jit(cfg, params, cache, tok[:, None], ones)
    return out


def generate_with_images(cfg: ModelConfig, vcfg: VisionConfig | None, params, prompts, pixels, grid_thws,
                         max_new_tokens: int, sampling=None, *, pad_id: int, **kw) -> list[list[int]]:
    """`generate` for prompts that carry images: the pads are expanded
    (`expand_prompts`), the image features are computed once, prefill writes them into the
    pad rows, and decode continues on the cache as for text. Returns the generated ids."""
    from k3jax.model.multimodal import image_features, prepare_images, split_params
    from k3jax.vision.inputs import expand_prompts

    images = prepare_images(vcfg, pixels, grid_thws)
    expanded = expand_prompts(prompts, images.rows, pad_id)
    feats = image_features(cfg, vcfg, params, images)
    text, _ = split_params(params)
    return generate(cfg, text, [p.tolist() for p in expanded], max_new_tokens, sampling or SamplingParams(),
                    image_features=feats, media_pad_id=pad_id, **kw)
