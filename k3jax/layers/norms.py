"""RMSNorm (fp32 math) and the sigmoid-gated RMSNorm of KDA's output."""
from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import linen as nn

from k3jax.layers.common import logical


def rms_normalize(x, eps: float):
    """x * rsqrt(mean(x²) + eps) over the last axis, in fp32."""
    x = x.astype(jnp.float32)
    return x * jax.lax.rsqrt(jnp.mean(jnp.square(x), axis=-1, keepdims=True) + eps)


class RMSNorm(nn.Module):
    """Kimi's RMSNorm: normalise in fp32, cast back to the input dtype, then scale.

    The cast happens before the weight multiply, as in the reference, so bf16 runs round
    exactly where the checkpoint's own code does.
    """
    eps: float
    axis_name: str = "embed"

    @nn.compact
    def __call__(self, x):
        w = self.param("weight", logical(nn.initializers.ones, (self.axis_name,)), (x.shape[-1],), jnp.float32)
        y = rms_normalize(x, self.eps).astype(x.dtype)
        return (w.astype(jnp.promote_types(x.dtype, w.dtype)) * y).astype(x.dtype)


class GatedRMSNorm(nn.Module):
    """`RMSNorm(o) * weight * sigmoid(gate)` per head, all in fp32 (KDA's o_norm)."""
    eps: float

    @nn.compact
    def __call__(self, o, gate):
        w = self.param("weight", logical(nn.initializers.ones, ("head_dim",)), (o.shape[-1],), jnp.float32)
        y = rms_normalize(o, self.eps) * w * jax.nn.sigmoid(gate.astype(jnp.float32))
        return y
