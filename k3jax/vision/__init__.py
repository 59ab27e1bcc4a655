"""K3's native vision outside the tower itself: preprocessing, the checkpoint name map,
writing image features into the text stream (`merge`) and the model with images next to
tokens (`multimodal`: logits, generation, params). The tower is `k3jax.layers.vision`."""
from k3jax.vision.merge import feature_rows, merge_image_features
from k3jax.vision.preprocess import (MEDIA_PAD_TOKEN_ID, MediaConfig, expand_media_pads, patchify,
                                     preprocess_images, resize_plan)

__all__ = ["feature_rows", "merge_image_features", "MEDIA_PAD_TOKEN_ID", "MediaConfig", "expand_media_pads",
           "patchify", "preprocess_images", "resize_plan"]
