"""K3's native vision, the input side: preprocessing images into the tower's packed patches
(`preprocess`), the checkpoint name map (`k3jax.checkpoint.vision_names`) and prompts and images
from the command line (`inputs`). The tower is `k3jax.layers.vision`; the model with images next
to tokens is `k3jax.model.multimodal`."""
from k3jax.vision.preprocess import (MEDIA_PAD_TOKEN_ID, MediaConfig, expand_media_pads, patchify,
                                     preprocess_images, resize_plan)

__all__ = ["MEDIA_PAD_TOKEN_ID", "MediaConfig", "expand_media_pads", "patchify", "preprocess_images", "resize_plan"]
