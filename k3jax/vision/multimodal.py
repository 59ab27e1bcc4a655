"""Images next to tokens: the vision tower, 2×2 merge and projector in front of the text model.

Params of a multimodal model are the text tree (`K3Model`'s) plus one more top-level key,
`vision` = {'vision_tower', 'mm_projector'} (`k3jax.layers.vision.KimiVision`). Text-only
code never sees it: `split_params` hands the text tree to `K3Model` and the vision tree to
the tower, so text-only models, shardings and optimizers keep their exact trees.

Token side: each image is announced by `<|media_pad|>` (config.json's
`media_placeholder_token_id`, 163605 in K3). Prompts hold either one pad per image
(`expand_prompts` repeats it into the image's rows) or the expanded pads already; the k-th
pad of a batch (row-major) takes feature row k. A count that fits neither is an error.

Images arrive in the reference's packed layout: pixels [Σ t·h·w, 3, P, P] and grid_thws
[N, 3] (`k3jax.vision.preprocess.preprocess_images` makes both from image files). The grids
are static: each distinct set compiles once.
"""
from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from k3jax.config import K3Config, ModelConfig, VisionConfig
from k3jax.layers.common import compute_dtype
from k3jax.layers.vision import Grid, KimiVision, check_grids, check_pixels, rows_per_image
from k3jax.model import InputError, K3Model, validate_inputs, variables_of
from k3jax.vision.merge import check_media_rows, feature_rows
from k3jax.vision.preprocess import MEDIA_PAD_TOKEN_ID, expand_media_pads

VISION_KEY = "vision"


def media_pad_id(k3: K3Config) -> int:
    """The `<|media_pad|>` id of a config (K3's 163605 unless config.json says otherwise)."""
    return int(k3.top.get("media_placeholder_token_id", MEDIA_PAD_TOKEN_ID))


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


# ----------------------------------------------------------------------------- token side

def expand_prompts(prompts: Sequence[Sequence[int]], rows: Sequence[int], pad_id: int) -> list[np.ndarray]:
    """Each prompt with its `<|media_pad|>` tokens expanded into the images' rows.

    Images are consumed in order across the prompts. Pads already expanded (Σ rows of them
    over all prompts) are left as they are; any other count is an error.
    """
    prompts = [np.asarray(p).reshape(-1) for p in prompts]
    counts = [int(np.sum(p == pad_id)) for p in prompts]
    if sum(counts) == sum(rows):
        return prompts
    if sum(counts) != len(rows):
        raise InputError(f"the tokens hold {sum(counts)} <|media_pad|> ({pad_id}) but {len(rows)} image(s) were "
                         f"given, which need one pad each (or {sum(rows)} pads already expanded)")
    out, i = [], 0
    for p, c in zip(prompts, counts):
        out.append(expand_media_pads(p, rows[i:i + c], pad_id))
        i += c
    return out


def expand_tokens(tokens, rows: Sequence[int], pad_id: int) -> np.ndarray:
    """`expand_prompts` for a [B, T] batch; the expanded rows must come out equally long."""
    tokens = np.asarray(tokens)
    if tokens.ndim == 1:
        tokens = tokens[None]
    out = expand_prompts(list(tokens), rows, pad_id)
    if len({len(r) for r in out}) > 1:
        raise InputError(f"expanding the <|media_pad|> tokens gives rows of lengths {[len(r) for r in out]}; "
                         f"a [batch, length] input needs equal lengths (expand and pad the rows yourself)")
    return np.stack(out).astype(tokens.dtype)


# ----------------------------------------------------------------------------- model side

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


# ----------------------------------------------------------------------------- commands

def images_from_files(model_dir, vcfg: VisionConfig | None, files) -> tuple[np.ndarray, np.ndarray]:
    """(pixels, grid_thws) of image files, preprocessed with the checkpoint's
    preprocessor_config.json (K3's defaults without one), which must agree with the tower."""
    from k3jax.config import ConfigError
    from k3jax.vision.preprocess import MediaConfig, preprocess_images

    if vcfg is None:
        raise InputError("images were given, but this model has no vision tower (no vision_config)")
    mc = MediaConfig.from_dir(model_dir)
    if mc.patch_size != vcfg.patch_size or (mc.merge_kernel_size,) * 2 != tuple(vcfg.merge_kernel_size):
        raise ConfigError(f"preprocessor_config.json (patch {mc.patch_size}, merge {mc.merge_kernel_size}) "
                          f"disagrees with vision_config (patch {vcfg.patch_size}, merge "
                          f"{tuple(vcfg.merge_kernel_size)})")
    return preprocess_images(list(files), mc)


def images_from_args(args, vcfg: VisionConfig | None, model_dir):
    """(pixels, grid_thws) from a command's --image FILE... or --pixels/--grids, else None."""
    if getattr(args, "image", None):
        if getattr(args, "pixels", None) or getattr(args, "grids", None):
            raise InputError("--image computes pixels and grids itself; give either --image or --pixels/--grids")
        return images_from_files(model_dir, vcfg, args.image)
    if getattr(args, "pixels", None) or getattr(args, "grids", None):
        if not (args.pixels and args.grids):
            raise InputError("--pixels and --grids go together (pixels [num_patches, 3, P, P], grids [num_images, 3])")
        return load_npy(args.pixels, "--pixels"), load_npy(args.grids, "--grids")
    return None


def load_npy(path: str, what: str) -> np.ndarray:
    try:
        arr = np.load(path, allow_pickle=False)
    except (ValueError, EOFError) as e:   # not a .npy file, or a truncated one (a missing file stays FileNotFoundError)
        raise InputError(f"{what} {path}: not a readable .npy array ({e})") from None
    if not isinstance(arr, np.ndarray):
        keys = list(arr.keys())
        arr.close()
        raise InputError(f"{what} {path}: expected one .npy array, got an .npz archive with keys {keys}")
    return arr
