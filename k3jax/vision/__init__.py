"""K3's native vision outside the tower itself: preprocessing, the checkpoint name map and
writing image features into the text stream. The tower is `k3jax.layers.vision`."""
from k3jax.vision.merge import merge_image_features
from k3jax.vision.preprocess import (MEDIA_PAD_TOKEN_ID, MediaConfig, expand_media_pads, patchify,
                                     preprocess_images, resize_plan)

__all__ = ["merge_image_features", "MEDIA_PAD_TOKEN_ID", "MediaConfig", "expand_media_pads", "patchify",
           "preprocess_images", "resize_plan"]
