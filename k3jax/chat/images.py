"""Images inside messages: where each one's bytes are, and its size.

An image part is `{"type": "image_url", "image_url": {"url": URL}}` (OpenAI shape; the url
may also be the value itself) or `{"type": "image", "image": X}`. A source is a `data:` URL
(base64), a `file://` URL or a local path (relative paths against `base_dir`, e.g. the
JSONL file's folder), bytes, a PIL image or an [H, W(, C)] array. http(s) URLs are not
fetched: give such images as files.

Images are numbered in the order the renderer meets them (tool results put in call order).
"""
from __future__ import annotations

import base64
import binascii
import os

import numpy as np

from k3jax.chat.messages import in_render_order


def _parts(messages):
    for i, m in in_render_order(list(messages)):
        content = m.get("content") if isinstance(m, dict) else None
        if isinstance(content, (list, tuple)):
            for k, part in enumerate(content):
                if isinstance(part, dict) and part.get("type") in ("image", "image_url"):
                    yield i, k, m.get("role"), part


def image_source(part: dict, base_dir: str | None = None):
    """The image a part holds (bytes, a path, a PIL image or an array), or None when it is
    only a remote URL."""
    value = part.get("image") if part.get("type") == "image" else part.get("image_url")
    if isinstance(value, dict):
        value = value.get("url")
    if value is None:
        return None
    if isinstance(value, (bytes, bytearray, np.ndarray)) or hasattr(value, "size") and hasattr(value, "mode"):
        return value
    if not isinstance(value, str):
        return None
    if value.startswith("data:"):
        head, _, data = value.partition(",")
        if ";base64" not in head:
            raise ValueError(f"image data URL {head!r}...: only base64 data URLs are supported")
        try:
            return base64.b64decode(data, validate=False)
        except binascii.Error as e:
            raise ValueError(f"image data URL {head!r}...: bad base64 ({e})") from None
    if value.startswith(("http://", "https://")):
        return None
    path = value[len("file://"):] if value.startswith("file://") else value
    if base_dir is not None and not os.path.isabs(path):
        path = os.path.join(base_dir, path)
    return path if os.path.exists(path) else None


def image_size(src) -> tuple[int, int]:
    """(width, height) of an image source."""
    if isinstance(src, np.ndarray):
        if src.ndim not in (2, 3):
            raise ValueError(f"an image array must be [H, W] or [H, W, C], got shape {src.shape}")
        return int(src.shape[1]), int(src.shape[0])
    from k3jax.vision.preprocess import load_image
    img = load_image(src)
    return int(img.width), int(img.height)


def image_sizes_of(messages, base_dir: str | None = None) -> list[tuple[int, int]] | None:
    """Sizes of every image in the messages, read from the images themselves; None when the
    conversation has no image whose bytes are at hand (the renderer then writes K3's
    placeholder). Some readable and some not is an error: pass `image_sizes` then."""
    parts = list(_parts(messages))
    if not parts:
        return None
    sources = [image_source(p, base_dir) for *_, p in parts]
    if all(s is None for s in sources):
        return None
    missing = [f"message {i} part {k}" for (i, k, _, _), s in zip(parts, sources) if s is None]
    if missing:
        raise ValueError(f"the images of {', '.join(missing)} are not readable here (remote URL or missing file); "
                         f"give every image as a file or data URL, or pass image_sizes")
    return [image_size(s) for s in sources]


def user_images(messages, base_dir: str | None = None, where: str = "conversation") -> list:
    """The image sources of a training conversation, in order. Only user messages may hold
    images (K3's processor collects no others); each one must be readable."""
    out = []
    for i, k, role, part in _parts(messages):
        if role != "user":
            raise ValueError(f"{where}: message {i} ({role}) holds an image; K3 takes images in user messages only")
        src = image_source(part, base_dir)
        if src is None:
            raise ValueError(f"{where}: message {i} part {k}: image not found or remote "
                             f"({str(part)[:120]}); give it as a local file or a data URL")
        out.append(src)
    return out
