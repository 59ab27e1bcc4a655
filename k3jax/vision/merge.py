"""Writing image features into the text embedding stream.

The reference model expands each single `<|media_pad|>` into the image's rows inside its
forward, which changes the sequence length there. k3jax expands on the token side instead
(`k3jax.vision.preprocess.expand_media_pads`), so shapes are fixed before jit and the model
only overwrites rows: the k-th `<|media_pad|>` position (row-major over the batch) receives
feature row k, images in order. `feature_rows` turns tokens into that position → row map,
which `K3Model` takes next to the features.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from k3jax.errors import InputError
from k3jax.layers.vision import VisionInputError
from k3jax.ops.splice import splice_rows


def feature_rows(tokens, media_pad_id: int, valid=None):
    """int32 [..., T]: k at the k-th `<|media_pad|>` (row-major), −1 at every other position.

    `valid` (bool, like tokens) excludes positions such as right padding from counting.
    Concrete tokens give a numpy array (computed on the host, sliceable per prefill chunk);
    traced tokens give the same map in the graph.
    """
    xp = jnp if isinstance(tokens, jax.core.Tracer) or isinstance(valid, jax.core.Tracer) else np
    mask = xp.asarray(tokens) == media_pad_id
    if valid is not None:
        mask = mask & xp.asarray(valid, bool)
    k = xp.cumsum(mask.reshape(-1).astype(xp.int32)).reshape(mask.shape) - 1
    return xp.where(mask, k, -1).astype(xp.int32)


def merge_image_features(token_embeddings, tokens, features, media_pad_id: int):
    """token_embeddings [..., T, D] with its `<|media_pad|>` rows replaced by `features` [N, D].

    `tokens` [..., T] must already be expanded (one pad per feature row). With concrete tokens
    the pad count is checked against N; under jit it cannot be, so callers that trace must
    guarantee it (surplus feature rows are ignored, missing ones would repeat the last row).
    """
    emb = jnp.asarray(token_embeddings)
    if emb.ndim < 2 or tuple(jnp.shape(tokens)) != emb.shape[:-1]:
        raise VisionInputError(f"tokens {tuple(jnp.shape(tokens))} must match token_embeddings "
                               f"{emb.shape} without its last (feature) axis")
    if features.ndim != 2 or features.shape[-1] != emb.shape[-1]:
        raise VisionInputError(f"features must be [num_rows, {emb.shape[-1]}], got {tuple(features.shape)}")
    if not isinstance(tokens, jax.core.Tracer):
        n_pad = int(np.sum(np.asarray(tokens) == media_pad_id))
        if n_pad != features.shape[0]:
            raise VisionInputError(f"{n_pad} <|media_pad|> ({media_pad_id}) positions but {features.shape[0]} "
                                   f"feature rows; expand the pads with expand_media_pads first")
    if features.shape[0] == 0:
        return emb
    rows = jnp.minimum(jnp.asarray(feature_rows(tokens, media_pad_id)), features.shape[0] - 1)
    return splice_rows(emb, jnp.asarray(features), rows)


def check_media_rows(tokens, pad_id: int, n_rows: int, valid=None) -> None:
    """The `<|media_pad|>` count of concrete tokens must equal the projected feature rows."""
    mask = np.asarray(tokens) == pad_id
    if valid is not None:
        mask &= np.asarray(valid, bool)
    n = int(mask.sum())
    if n != n_rows:
        raise InputError(f"{n} <|media_pad|> ({pad_id}) position(s) but the images project to {n_rows} feature "
                         f"row(s); expand the pads into each image's rows first (expand_prompts)")
