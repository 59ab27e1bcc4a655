"""Small pieces every layer uses: dtypes, initialisers with logical axes, projections."""
from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import linen as nn

from k3jax.config import ModelConfig

# Contractions feeding a softmax or a top-k selection (AttnRes scores, router logits) run
# at full fp32 precision: at TPU default precision they lose ~3 significant digits.
HIGHEST = jax.lax.Precision.HIGHEST


def compute_dtype(cfg: ModelConfig):
    return jnp.dtype(cfg.runtime.dtype)


def param_dtype(cfg: ModelConfig):
    return jnp.dtype(cfg.runtime.param_dtype)


def matrix_init(axes: tuple[str, ...], in_axis: int = -2):
    """Fan-in scaled truncated normal, tagged with logical axis names."""
    init = nn.initializers.variance_scaling(1.0, "fan_in", "truncated_normal", in_axis=in_axis)
    return nn.with_logical_partitioning(init, axes)


def logical(init, axes: tuple[str, ...]):
    return nn.with_logical_partitioning(init, axes)


def dense(cfg: ModelConfig, features: int, axes: tuple[str, str], name: str,
          precision=None) -> nn.Dense:
    """A bias-free projection; kernel [in, out] (the checkpoint stores [out, in])."""
    return nn.Dense(features, use_bias=False, dtype=compute_dtype(cfg), param_dtype=param_dtype(cfg),
                    kernel_init=matrix_init(axes), precision=precision, name=name)


def constrain(x, axes: tuple[str | None, ...]):
    """Activation sharding hint by logical axes; a no-op outside a mesh with rules."""
    return nn.with_logical_constraint(x, axes)


class TokenEmbed(nn.Embed):
    """nn.Embed whose lookup reads the table gathered whole along `embed`.

    The table is sharded along `embed` (ZeRO-3) while tokens are sharded along `batch`. A
    plain lookup leaves the backward's scatter-add to move the batch-sharded cotangent
    onto the embed-sharded table, which XLA can only do by replicating the whole
    [B, T, D] cotangent on every device. Gathering the (compute-dtype) table first makes
    the backward a local scatter-add whose sum over the batch shards reduces onto the
    table's sharding, like every other weight gradient.
    """

    def __call__(self, inputs):
        if not jnp.issubdtype(inputs.dtype, jnp.integer):
            raise ValueError(f"token ids must be integers, got {inputs.dtype}")
        (table,) = self.promote_dtype(self.embedding, dtype=self.dtype, inexact=False)
        return jnp.take(constrain(table, ("vocab", None)), inputs, axis=0)
