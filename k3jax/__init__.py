"""k3jax: Kimi K3 in pure-functional JAX / Flax."""

__version__ = "0.1.0"
