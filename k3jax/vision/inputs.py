"""Images next to tokens, the input side: the `<|media_pad|>` id of a checkpoint, prompts with
their pads expanded into each image's feature rows, and images read from the command line
(files through the checkpoint's preprocessor, or packed .npy arrays). The model side (tower,
features into the token stream) is `k3jax.model.multimodal`.
"""
from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from k3jax.config import K3Config, VisionConfig
from k3jax.errors import InputError
from k3jax.vision.preprocess import MEDIA_PAD_TOKEN_ID, expand_media_pads


def media_pad_id(k3: K3Config) -> int:
    """The `<|media_pad|>` id of a config (K3's 163605 unless config.json says otherwise)."""
    return int(k3.top.get("media_placeholder_token_id", MEDIA_PAD_TOKEN_ID))


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
