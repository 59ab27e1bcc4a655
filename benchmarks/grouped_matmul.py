"""The MoE grouped matmul on this backend, side by side on the same inputs: jax.lax.ragged_dot
(autodiff: XLA's transpose for the weight gradient), k3jax's CPU row tiles, and our Pallas
kernels (pallas_kernels.gmm: gmm forward, gmm through Wᵀ for dx, tgmm for dW; on CPU in
interpret mode, so the kernels stay honest where no accelerator is lent).

    python benchmarks/grouped_matmul.py [--pallas-too]

Prints, per shape, forward and forward+backward times and each one's ratio to ragged_dot.
On CPU XLA lowers ragged_dot to every row times every expert's weight (E× the FLOPs), the
row tiles run each group's rows, and interpret mode runs each grid step as XLA ops (its
times say the kernels' visit structure is sane, not what a TPU or GPU would do: those are
benchmarks/compile/gmm_tpu_compile.py's compile checks). On TPU/GPU "auto" is the kernels.
"""
from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp
import numpy as np

from k3jax.ops.grouped_matmul import grouped_matmul
from kda import best_time  # benchmarks/kda.py


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pallas-too", action="store_true",
                    help="also the kernels (interpret mode off an accelerator: minutes on CPU)")
    args = ap.parse_args()
    print(f"backend {jax.default_backend()}")
    shapes = [(16384, 8, 256, 256), (16384, 64, 256, 128), (4096, 256, 64, 32)]
    if args.pallas_too and jax.default_backend() == "cpu":
        shapes = [(2048, 8, 256, 256), (2048, 64, 128, 128)]   # interpret mode: one XLA call a grid step
    for rows, experts, d, f in shapes:
        rng = np.random.default_rng(0)
        x = jnp.asarray(rng.standard_normal((rows, d)), jnp.float32)
        w = jnp.asarray(rng.standard_normal((experts, d, f)), jnp.float32)
        sizes = jnp.asarray(np.bincount(rng.integers(0, experts, rows), minlength=experts), jnp.int32)
        fns = {"ragged_dot": lambda x, w: jax.lax.ragged_dot(x, w, sizes),
               "tiled": lambda x, w: grouped_matmul(x, w, sizes, impl="tiled")}
        if args.pallas_too:
            fns["pallas"] = lambda x, w: grouped_matmul(x, w, sizes, impl="pallas")
        t = {}
        for name, fn in fns.items():
            fwd = jax.jit(fn)
            bwd = jax.jit(jax.grad(lambda x, w, fn=fn: jnp.sum(fn(x, w) ** 2), argnums=(0, 1)))
            t[name] = (best_time(lambda: fwd(x, w), 3), best_time(lambda: bwd(x, w), 2))
        rf, rb = t["ragged_dot"]
        line = f"rows {rows:6d} experts {experts:4d} {d}x{f}: ragged_dot fwd {rf * 1e3:8.1f} ms, fwd+bwd {rb * 1e3:8.1f} ms"
        for name, (gf, gb) in t.items():
            if name != "ragged_dot":
                line += f" | {name} {gf * 1e3:7.1f} ms ({rf / gf:5.1f}x), {gb * 1e3:7.1f} ms ({rb / gb:5.1f}x)"
        print(line, flush=True)


if __name__ == "__main__":
    main()
