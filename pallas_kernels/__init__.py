"""Pallas kernels, called only through k3jax.ops."""
