"""The MoE grouped matmul on this backend: k3jax.ops.grouped_matmul against jax.lax.ragged_dot,
forward and forward+backward, side by side on the same inputs.

    python benchmarks/grouped_matmul.py

On CPU, XLA lowers ragged_dot to every row times every expert's weight (E× the FLOPs);
grouped_matmul runs row tiles there. Elsewhere both are ragged_dot and the ratio is ~1.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from k3jax.ops.grouped_matmul import grouped_matmul
from kda import best_time  # benchmarks/kda.py


def main():
    print(f"backend {jax.default_backend()}")
    for rows, experts, d, f in [(16384, 8, 256, 256), (16384, 64, 256, 128), (4096, 256, 64, 32)]:
        rng = np.random.default_rng(0)
        x = jnp.asarray(rng.standard_normal((rows, d)), jnp.float32)
        w = jnp.asarray(rng.standard_normal((experts, d, f)), jnp.float32)
        sizes = jnp.asarray(np.bincount(rng.integers(0, experts, rows), minlength=experts), jnp.int32)
        fns = {"ragged_dot": lambda x, w: jax.lax.ragged_dot(x, w, sizes), "grouped_matmul": lambda x, w: grouped_matmul(x, w, sizes)}
        t = {}
        for name, fn in fns.items():
            fwd = jax.jit(fn)
            bwd = jax.jit(jax.grad(lambda x, w, fn=fn: jnp.sum(fn(x, w) ** 2), argnums=(0, 1)))
            t[name] = (best_time(lambda: fwd(x, w), 3), best_time(lambda: bwd(x, w), 2))
        (rf, rb), (gf, gb) = t["ragged_dot"], t["grouped_matmul"]
        print(f"rows {rows:6d} experts {experts:4d} {d}x{f}: fwd {rf * 1e3:8.1f} -> {gf * 1e3:7.1f} ms "
              f"({rf / gf:5.1f}x)   fwd+bwd {rb * 1e3:8.1f} -> {gb * 1e3:7.1f} ms ({rb / gb:5.1f}x)")


if __name__ == "__main__":
    main()
