"""Image preprocessing as the K3 processor does it, in numpy + Pillow (no torch).

decode → composite transparency onto K3's chessboard → shrink (bicubic, aspect kept) until the
patch budget and the per-side limit hold → zero-pad bottom/right to a multiple of
merge_kernel·patch (28 px) → (x/255 − mean)/std → patchify into the reference's packed layout
([num_patches, 3, P, P], patches (t, row, col) row-major, each channel-major (c, y, x)).

Padding rather than stretching to the multiple of 28 is what the processor does: the image
keeps its aspect ratio and the pad reads as black (0 before normalisation).

On the text side each image is announced by one `<|media_pad|>` token; `expand_media_pads`
repeats it once per feature row so sequence lengths are known before the model runs.
"""
from __future__ import annotations

import json
import math
import os
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from k3jax.layers.vision import VisionInputError

MEDIA_PAD_TOKEN_ID = 163605  # <|media_pad|> = config.json's media_placeholder_token_id


@dataclass(frozen=True)
class MediaConfig:
    """The processor's `media_proc_cfg` (preprocessor_config.json); defaults are K3's."""
    patch_size: int = 14
    merge_kernel_size: int = 2
    in_patch_limit: int = 65536          # patch budget per image (before the 2×2 merge)
    patch_limit_on_one_side: int = 512   # = the ViT's RoPE table side
    image_mean: tuple[float, float, float] = (0.5, 0.5, 0.5)
    image_std: tuple[float, float, float] = (0.5, 0.5, 0.5)
    chessboard: dict = field(default_factory=lambda: {"square_size": 8, "white": 255, "gray": 180,
                                                      "gray_on_top_left": False})

    @classmethod
    def from_dir(cls, path) -> "MediaConfig":
        """Read `preprocessor_config.json` next to a checkpoint if there is one, else K3's defaults."""
        f = os.path.join(os.fspath(path), "preprocessor_config.json")
        if not os.path.isfile(f):
            return cls()
        with open(f) as fh:
            raw = json.load(fh)
        cfg = raw.get("media_proc_cfg", raw)
        kw = {}
        for k in ("patch_size", "in_patch_limit", "patch_limit_on_one_side"):
            if cfg.get(k) is not None:
                kw[k] = int(cfg[k])
        mk = cfg.get("merge_kernel_size")
        if mk is not None:
            kw["merge_kernel_size"] = int(mk[0] if isinstance(mk, (list, tuple)) else mk)
        for k in ("image_mean", "image_std"):
            if cfg.get(k) is not None:
                kw[k] = tuple(float(x) for x in cfg[k])
        return cls(**kw)


def resize_plan(width: int, height: int, mc: MediaConfig) -> dict[str, int]:
    """Target size, padding and grid of one image.

    The scale is the largest ≤ 1 that keeps (w/P)·(h/P) ≤ in_patch_limit and each side within
    patch_limit_on_one_side patches; sizes are truncated, then padded up to the merge window.
    """
    if width < 1 or height < 1:
        raise VisionInputError(f"image size {width}x{height} must be positive")
    p, lim = mc.patch_size, mc.patch_limit_on_one_side
    budget = math.sqrt(mc.in_patch_limit / (max(1.0, width // p) * max(1.0, height // p)))
    scale = min(1.0, budget, lim * p / width, lim * p / height)
    new_w = min(max(1, int(width * scale)), lim * p)
    new_h = min(max(1, int(height * scale)), lim * p)
    f = mc.merge_kernel_size * p
    pad_w, pad_h = (-new_w) % f, (-new_h) % f
    grid_h, grid_w = (new_h + pad_h) // p, (new_w + pad_w) // p
    return {"new_width": new_w, "new_height": new_h, "pad_width": pad_w, "pad_height": pad_h,
            "grid_t": 1, "grid_h": grid_h, "grid_w": grid_w,
            "num_tokens": (grid_h // mc.merge_kernel_size) * (grid_w // mc.merge_kernel_size)}


def _pil():
    # Pillow is only needed for image files, not for pre-patchified pixels
    from k3jax.errors import require
    return require("PIL.Image", "vision", "decoding image files (--image)", package="pillow")


def load_image(src):
    """A PIL image from a path, bytes or an existing PIL image (decoded, not yet converted)."""
    Image = _pil()
    if isinstance(src, Image.Image):
        return src
    if isinstance(src, (bytes, bytearray)):
        import io
        src = io.BytesIO(src)
    try:
        img = Image.open(src)
        img.load()
    except (OSError, Image.DecompressionBombError) as e:
        raise VisionInputError(f"cannot decode image {src!r}: {e}") from None
    return img


def _to_rgb(img, mc: MediaConfig) -> np.ndarray:
    """uint8 [H, W, 3]; alpha (or palette transparency) composited onto the K3 chessboard."""
    if img.mode == "RGB":
        return np.asarray(img)
    if "A" not in img.getbands() and "transparency" not in img.info:
        return np.asarray(img.convert("RGB"))
    rgba = np.asarray(img.convert("RGBA")).astype(np.float32)
    h, w = rgba.shape[:2]
    cb = mc.chessboard
    yy, xx = np.arange(h)[:, None] // cb["square_size"], np.arange(w)[None, :] // cb["square_size"]
    gray = (xx + yy) % 2 == (0 if cb["gray_on_top_left"] else 1)
    bg = np.where(gray[..., None], float(cb["gray"]), float(cb["white"]))
    a = rgba[..., 3:4] / 255.0
    return (a * rgba[..., :3] + (1.0 - a) * bg).astype(np.uint8)


def image_to_frames(src, mc: MediaConfig = MediaConfig()) -> np.ndarray:
    """One image → normalised float32 [1, H, W, 3] with H, W multiples of merge·patch."""
    Image = _pil()
    img = load_image(src)
    plan = resize_plan(img.width, img.height, mc)
    if (plan["new_width"], plan["new_height"]) != img.size:
        # K3 resizes first and composites transparency afterwards ("after_resize"), so the
        # chessboard stays crisp; keep alpha through the resize for that.
        mode = "RGBA" if ("A" in img.getbands() or "transparency" in img.info) else "RGB"
        img = img.convert(mode).resize((plan["new_width"], plan["new_height"]), resample=Image.Resampling.BICUBIC)
    arr = _to_rgb(img, mc)
    arr = np.pad(arr, ((0, plan["pad_height"]), (0, plan["pad_width"]), (0, 0)))
    return normalize(arr[None], mc)


def normalize(frames_u8: np.ndarray, mc: MediaConfig = MediaConfig()) -> np.ndarray:
    """(x/255 − mean)/std per channel (R, G, B), float32."""
    x = np.asarray(frames_u8).astype(np.float32) / 255.0
    return (x - np.asarray(mc.image_mean, np.float32)) * (1.0 / np.asarray(mc.image_std, np.float32))


def patchify(frames: np.ndarray, patch_size: int = 14) -> tuple[np.ndarray, tuple[int, int, int]]:
    """[T, H, W, 3] → ([T·(H/P)·(W/P), 3, P, P] patches in (t, row, col) order, (T, H/P, W/P))."""
    frames = np.asarray(frames)
    if frames.ndim != 4 or frames.shape[-1] != 3:
        raise VisionInputError(f"frames must be [T, H, W, 3] (channels last, RGB), got {frames.shape}")
    t, h, w, c = frames.shape
    p = patch_size
    if h % p or w % p:
        raise VisionInputError(f"frame size {h}x{w} is not a multiple of the patch size {p}")
    x = frames.reshape(t, h // p, p, w // p, p, c).transpose(0, 1, 3, 5, 2, 4)
    return np.ascontiguousarray(x.reshape(-1, c, p, p)), (t, h // p, w // p)


def preprocess_images(images: Sequence, mc: MediaConfig = MediaConfig()) -> tuple[np.ndarray, np.ndarray]:
    """Files / bytes / PIL images → (pixels [L, 3, P, P] float32, grid_thws [N, 3] int64)."""
    if not images:
        raise VisionInputError("no images given")
    pix, grids = [], []
    for src in images:
        p, g = patchify(image_to_frames(src, mc), mc.patch_size)
        pix.append(p)
        grids.append(g)
    return np.concatenate(pix).astype(np.float32), np.asarray(grids, np.int64)


def expand_media_pads(tokens, rows_per_image: Sequence[int], media_pad_id: int = MEDIA_PAD_TOKEN_ID) -> np.ndarray:
    """1-D token ids with the i-th `<|media_pad|>` repeated rows_per_image[i] times.

    The count of pads must equal the number of images: a prompt that announces more or fewer
    images than it is given is an error, never silently truncated.
    """
    tokens = np.asarray(tokens)
    if tokens.ndim != 1:
        raise VisionInputError(f"expand_media_pads takes one 1-D token sequence, got shape {tokens.shape}")
    where = np.flatnonzero(tokens == media_pad_id)
    if len(where) != len(rows_per_image):
        raise VisionInputError(f"the tokens hold {len(where)} <|media_pad|> ({media_pad_id}) but "
                               f"{len(rows_per_image)} images were given")
    reps = np.ones(len(tokens), np.int64)
    reps[where] = np.asarray(rows_per_image, np.int64)
    return np.repeat(tokens, reps)
