"""Images next to tokens, the model side: the vision tower, 2×2 merge and projector in front of
the text model, and where their feature rows go in the token stream.

Params of a multimodal model are the text tree (`K3Model`'s) plus one more top-level key,
`vision` = {'vision_tower', 'mm_projector'} (`k3jax.layers.vision.KimiVision`). Text-only
code never sees it: `split_params` hands the text tree to `K3Model` and the vision tree to
the tower, so text-only models, shardings and optimizers keep their exact trees.

The reference model expands each single `<|media_pad|>` into the image's rows inside its
forward, which changes the sequence length there. k3jax expands on the token side instead
(`k3jax.vision.inputs.expand_prompts`), so shapes are fixed before jit and the model only
overwrites rows: the k-th `<|media_pad|>` position (row-major over the batch) receives
feature row k, images in order. `feature_rows` turns tokens into that position → row map,
which `K3Model` takes next to the features.

Images arrive in the reference's packed layout: pixels [Σ t·h·w, 3, P, P] and grid_thws
[N, 3] (`k3jax.vision.preprocess.preprocess_images` makes both from image files). The grids
are static: each distinct set compiles once.
"""
from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from k3jax.config import ModelConfig, VisionConfig
from k3jax.errors import InputError
from k3jax.layers.common import compute_dtype
from k3jax.layers.vision import Grid, KimiVision, VisionInputError, check_grids, check_pixels, rows_per_image
from k3jax.model.transformer import K3Model, validate_inputs, variables_of
from k3jax.ops.splice import splice_rows

VISION_KEY = "vision"


def split_params(params) -> tuple[dict, dict | None]:
    """(text params, vision params or None) of a multimodal (or text-only) param tree."""
    if VISION_KEY not in params:
        return params, None
    return {k: v for k, v in params.items() if k != VISION_KEY}, params[VISION_KEY]


class Images(NamedTuple):
    """Validated packed images: pixels [Σ t·h·w, 3, P, P], static grids, feature rows per image."""
    pixels: jax.Array | np.ndarray
    grids: Grid
    rows: tuple[int, ...]

    @property
    def n_rows(self) -> int:
        return sum(self.rows)


def prepare_images(vcfg: VisionConfig | None, pixels, grid_thws) -> Images:
    """Check pixels and grid_thws against the vision config; refuse a model without a tower."""
    if vcfg is None:
        raise InputError("images were given, but this model has no vision tower (no vision_config)")
    grids = check_grids(vcfg, grid_thws)
    pixels = check_pixels(vcfg, pixels, grids)
    return Images(pixels, grids, tuple(rows_per_image(vcfg, grids)))


def _vision_params(params):
    _, vision = split_params(params)
    if vision is None:
        raise InputError("images were given, but the params hold no vision tower (load the checkpoint "
                         "with its vision weights: load_model_dir(..., vision=True))")
    return vision


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


def image_inputs(cfg: ModelConfig, vcfg: VisionConfig, vision_params, pixels, grids: Grid, tokens,
                 pad_id: int, valid=None) -> dict:
    """`K3Model` keyword arguments {'image_features', 'feature_rows'} (traceable)."""
    feats = KimiVision(vcfg, compute_dtype(cfg)).apply({"params": vision_params}, jnp.asarray(pixels), grids)
    return {"image_features": feats, "feature_rows": jnp.asarray(feature_rows(tokens, pad_id, valid))}


def image_features(cfg: ModelConfig, vcfg: VisionConfig, params, images: Images):
    """Projector rows [Σ rows, hidden] of validated images, in the text model's compute dtype."""
    return _features_jit(cfg, vcfg, images.grids, _vision_params(params), jnp.asarray(images.pixels))


@functools.partial(jax.jit, static_argnums=(0, 1, 2))
def _features_jit(cfg, vcfg, grids, vision_params, pixels):
    return KimiVision(vcfg, compute_dtype(cfg)).apply({"params": vision_params}, pixels, grids)


def forward_with_images(cfg: ModelConfig, vcfg: VisionConfig | None, params, tokens, pixels, grid_thws, *,
                        pad_id: int, segment_ids=None):
    """fp32 logits [B, T, V] of tokens whose (expanded) `<|media_pad|>` rows carry the images.

    Inputs are validated on the host before anything compiles: the tokens as in `forward`,
    the images against the vision config, and the pad count against the feature rows.
    """
    images = prepare_images(vcfg, pixels, grid_thws)
    vision = _vision_params(params)
    validate_inputs(cfg, tokens, segment_ids)
    check_media_rows(tokens, pad_id, images.n_rows)
    rows = feature_rows(np.asarray(tokens), pad_id)
    text, _ = split_params(params)
    return _forward_jit(cfg, vcfg, images.grids, text, vision, tokens, segment_ids, jnp.asarray(images.pixels),
                        rows)


@functools.partial(jax.jit, static_argnums=(0, 1, 2))
def _forward_jit(cfg, vcfg, grids, text, vision, tokens, segment_ids, pixels, rows):
    feats = KimiVision(vcfg, compute_dtype(cfg)).apply({"params": vision}, pixels, grids)
    return K3Model(cfg).apply(variables_of(text), tokens, segment_ids, image_features=feats, feature_rows=rows)
