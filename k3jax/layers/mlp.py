"""Gated MLPs: SiTU-GLU (K3) and SiLU-GLU (Kimi-Linear)."""
from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import linen as nn

from k3jax.config import ModelConfig
from k3jax.layers.common import dense


def situ_glu(gate, up, beta: float | None, linear_beta: float | None):
    """SiTU(g, u) = β1·tanh(g/β1)·σ(g) · β2·tanh(u/β2), in fp32 and cast back.

    The tanh caps keep |SiTU| < β1·β2 however large the pre-activations grow.
    """
    beta = beta or 1.0  # the reference's own fallback
    g = gate.astype(jnp.float32)
    u = up.astype(jnp.float32)
    a = beta * jnp.tanh(g / beta) * jax.nn.sigmoid(g)
    if linear_beta is not None:
        u = linear_beta * jnp.tanh(u / linear_beta)
    return (a * u).astype(gate.dtype)


def glu_activation(cfg: ModelConfig, gate, up):
    if cfg.hidden_act == "situ":
        return situ_glu(gate, up, cfg.activation_situ_beta, cfg.activation_situ_linear_beta)
    return jax.nn.silu(gate) * up


class GatedMLP(nn.Module):
    """down(act(gate(x), up(x))): the dense layer-0 MLP and the shared experts."""
    cfg: ModelConfig
    intermediate_size: int

    @nn.compact
    def __call__(self, x):
        cfg, f = self.cfg, self.intermediate_size
        g = dense(cfg, f, ("embed", "mlp"), "gate_proj")(x)
        u = dense(cfg, f, ("embed", "mlp"), "up_proj")(x)
        return dense(cfg, cfg.hidden_size, ("mlp", "embed"), "down_proj")(glu_activation(cfg, g, u))
