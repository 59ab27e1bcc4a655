"""The MXFP4 grouped matmul (pure path, dequantizing one expert at a time) against the bf16
`grouped_matmul` on the same values, side by side on this backend: forward, and the
gradient with respect to x (what LoRA over a frozen base needs), with the live bytes of
the weights each holds and XLA's temporaries for each program.

    python benchmarks/mxfp4_gmm.py [--rows-per-expert 16 128] [--reps 3]

Shapes: K3's toy config's experts (w1 [32, 64]) and a K3-like slice of one device's
experts (w1/w3 [3072, 3584], w2 [3584, 3072] in checkpoint [out, in] orientation, 8
experts). MXFP4 holds 17/32 byte per value (a half-byte code plus a 1-byte scale per 32),
bf16 2 bytes. On CPU both are row-tiled loops over the experts; the MXFP4 one also decodes
each expert (once, for all its row tiles).
"""
from __future__ import annotations

import argparse
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from k3jax.checkpoint.mxfp4 import dequantize_mxfp4  # noqa: E402
from k3jax.ops.grouped_matmul import grouped_matmul  # noqa: E402
from k3jax.ops.mxfp4_matmul import mxfp4_grouped_matmul  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from kda import best_time  # noqa: E402  (benchmarks/kda.py)

SHAPES = [("toy w1", 8, 32, 64), ("K3 w1/w3", 8, 3072, 3584), ("K3 w2", 8, 3584, 3072)]


def temp_mib(fn, *args):
    mem = jax.jit(fn).lower(*args).compile().memory_analysis()
    return getattr(mem, "temp_size_in_bytes", 0) / 2**20 if mem else float("nan")


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows-per-expert", type=int, nargs="+", default=[16, 128])
    ap.add_argument("--reps", type=int, default=3)
    args = ap.parse_args()
    print(f"backend {jax.default_backend()}; x and compute in bf16, fp32 accumulation; "
          f"best of {args.reps}")
    for name, E, N, K in SHAPES:
        rng = np.random.default_rng(0)
        packed = jnp.asarray(rng.integers(0, 256, (E, N, K // 2), dtype=np.uint8))
        scale = jnp.asarray(rng.integers(122, 130, (E, N, K // 32), dtype=np.uint8))
        # bf16 grouped_matmul takes [E, in, out]: the same values, transposed once here.
        w = jax.block_until_ready(jnp.swapaxes(dequantize_mxfp4(packed, scale, jnp.bfloat16), 1, 2))
        mx_bytes, bf_bytes = packed.nbytes + scale.nbytes, w.nbytes
        print(f"\n{name}: {E} experts of [{N}, {K}]; weights {mx_bytes / 2**20:8.2f} MiB MXFP4 vs "
              f"{bf_bytes / 2**20:8.2f} MiB bf16 ({mx_bytes / (E * N * K):.4f} vs "
              f"{bf_bytes / (E * N * K):.1f} byte/value, ratio {mx_bytes / bf_bytes:.3f})")
        for rpe in args.rows_per_expert:
            M = E * rpe
            sizes = jnp.asarray(np.bincount(rng.integers(0, E, M), minlength=E), jnp.int32)
            x = jnp.asarray(rng.standard_normal((M, K)), jnp.bfloat16)
            ct = jnp.asarray(rng.standard_normal((M, N)), jnp.bfloat16)

            def mx(x, p, s):
                return mxfp4_grouped_matmul(x, p, s, sizes)

            def bf(x, w):
                return grouped_matmul(x, w, sizes)

            def mx_dx(x, p, s, ct):
                return jax.vjp(lambda x: mx(x, p, s), x)[1](ct)[0]

            def bf_dx(x, w, ct):
                return jax.vjp(lambda x: bf(x, w), x)[1](ct)[0]

            f_mx, f_bf, d_mx, d_bf = (jax.jit(f) for f in (mx, bf, mx_dx, bf_dx))
            t = {"fwd": (best_time(lambda: f_mx(x, packed, scale), args.reps),
                         best_time(lambda: f_bf(x, w), args.reps)),
                 "dx": (best_time(lambda: d_mx(x, packed, scale, ct), args.reps),
                        best_time(lambda: d_bf(x, w, ct), args.reps))}
            temps = (temp_mib(mx, x, packed, scale), temp_mib(bf, x, w))
            line = "  ".join(f"{k} {a * 1e3:8.1f} vs {b * 1e3:8.1f} ms ({a / b:4.2f}x)" for k, (a, b) in t.items())
            print(f"  {rpe:4d} rows/expert (M={M:5d}): mxfp4 vs bf16  {line}  "
                  f"temporaries {temps[0]:7.2f} vs {temps[1]:7.2f} MiB")


if __name__ == "__main__":
    main()
