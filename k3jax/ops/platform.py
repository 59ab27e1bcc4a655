"""Which backend a traced program is for.

Usually this machine's (`jax.default_backend()`). An ahead-of-time compile for devices the
machine does not have (`k3jax compile` for a TPU topology, `jax.export` for CUDA) traces
on the CPU host, so it names its target in K3JAX_TARGET_BACKEND ('tpu', 'gpu'), and code
that picks a form by backend reads this instead of the default backend.
"""
from __future__ import annotations

import os

import jax


def target_backend() -> str:
    """K3JAX_TARGET_BACKEND when set, else JAX's default backend (read at trace time)."""
    return os.environ.get("K3JAX_TARGET_BACKEND") or jax.default_backend()
