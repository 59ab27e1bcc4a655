"""The optimizer state in host memory between updates (`runtime.optimizer_offload`).

A step with microbatches holds, while they run, the params, the fp32 gradient sum and one
microbatch's activations; the optimizer state is only read by the update at the end. Kept
in the host's pinned memory, it leaves the device for the whole microbatch loop: full K3
fine-tuning on v5p-1024 frees the 20 GiB a chip of its fp32 Muon momentum, which is what
16K tokens a chip needs (docs/performance.md). The state crosses PCIe twice a step (in
before the update, out after it); the values are untouched.

The transfer in must start after the microbatches. XLA traces a host buffer's move to the
device back to the step's argument and starts the copy there, overlapped with the loop, so
the device copy would be alive all along (seen on XLA:TPU). `fetch_after` therefore makes
the copy the body of a loop whose trip count XLA cannot know before the microbatches end:
it runs once, after them.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

HOST = "pinned_host"


def host_shardings(shardings):
    """The same shardings in the host's pinned memory."""
    return jax.tree.map(lambda s: s.with_memory_kind(HOST), shardings)


def to_host(tree):
    """Move a tree's arrays to pinned host memory (eagerly, or inside a jitted step)."""
    return jax.tree.map(lambda x: jax.device_put(x, jax.memory.Space.Host), tree)


def fetch_after(tree, after: jax.Array):
    """`tree` (in host memory) copied to the device once `after` (a scalar the microbatch
    loop produced) exists, not before; see the module docstring."""
    once = 1 + (after < 0).astype(jnp.int32)     # 1, which XLA cannot fold: after's sign is data
    zeros = jax.tree.map(lambda x: jnp.zeros(x.shape, x.dtype), tree)
    return jax.lax.fori_loop(0, once, lambda i, _: jax.tree.map(
        lambda x: jax.device_put(x, jax.memory.Space.Device), tree), zeros)
