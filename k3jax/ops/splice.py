"""Rows of image features written into a sequence of embeddings: the one splice both the
multimodal model (`K3Model`'s `image_features` / `feature_rows`) and
`k3jax.model.multimodal.merge_image_features` use."""
from __future__ import annotations

import jax.numpy as jnp


def splice_rows(h, features, rows):
    """h [..., D] with each position whose rows[...] = k >= 0 replaced by features[k]
    (features [N, D], rows like h without its last axis, -1 = keep h)."""
    picked = jnp.take(features.astype(h.dtype), jnp.maximum(rows, 0), axis=0)
    return jnp.where((rows >= 0)[..., None], picked, h)
