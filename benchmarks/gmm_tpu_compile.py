"""Compile the routed experts' grouped matmul (k3jax.ops.grouped_matmul, impl="pallas":
pallas_kernels.gmm through Mosaic) ahead of time for a TPU generation, on a machine
without one: forward, and forward+backward (dx through the same kernel, dW through tgmm)
at K3's expert shapes (w1/w3 [3584, 3072], w2 [3072, 3584], [in, out]) for one device's
experts. Prints compile time, XLA's temporaries per chip and the kernels' declared FLOPs
against the analytic count.

    TPU-PYTHON benchmarks/gmm_tpu_compile.py [--topology v5p:2x2x1 v6e:2x2 ...]
        [--experts 8] [--rows-per-expert 512] [--dtypes bfloat16 float32]

TPU-PYTHON as for benchmarks/kda_tpu_compile.py. Compiling is what Mosaic's checks need
(block tiling, the transposed product of tgmm, VMEM limits), so this finds what a pod would
find at its first step. Exits non-zero on failure.
"""
from __future__ import annotations

import argparse
import os
import re
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import topologies
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from k3jax.ops.grouped_matmul import grouped_matmul  # noqa: E402

WEIGHTS = {"w1/w3": (3584, 3072), "w2": (3072, 3584)}


def programs():
    def fwd(x, w, sizes):
        return grouped_matmul(x, w, sizes, impl="pallas")

    def loss(x, w, sizes):
        return jnp.sum(fwd(x, w, sizes).astype(jnp.float32) ** 2)

    return {"forward": (fwd, 1), "fwd+dx+dW": (jax.grad(loss, argnums=(0, 1)), 3)}


def declared_flops(hlo: str) -> float:
    return sum(float(f) for f in re.findall(r'"flops":"?(\d+)', hlo))


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--topology", nargs="+", default=["v4:2x2x1", "v5e:2x2", "v5p:2x2x1", "v6e:2x2"])
    ap.add_argument("--experts", type=int, default=8, help="experts on the device")
    ap.add_argument("--rows-per-expert", type=int, default=512)
    ap.add_argument("--dtypes", nargs="+", default=["bfloat16", "float32"])
    args = ap.parse_args()
    E, M = args.experts, args.experts * args.rows_per_expert
    failed = []
    for name in args.topology:
        topology = topologies.get_topology_desc(topology_name=name, platform="tpu")
        mesh = jax.sharding.Mesh(np.array(topology.devices[:1]), ("x",))
        rep = NamedSharding(mesh, P())
        for wname, (K, N) in WEIGHTS.items():
            for dtype in args.dtypes:
                inputs = (jax.ShapeDtypeStruct((M, K), jnp.dtype(dtype), sharding=rep),
                          jax.ShapeDtypeStruct((E, K, N), jnp.dtype(dtype), sharding=rep),
                          jax.ShapeDtypeStruct((E,), jnp.int32, sharding=rep))
                for what, (fn, products) in programs().items():
                    label = f"{name:10s} {wname:6s} [{K}, {N}] {dtype:9s} {what:10s}"
                    t0 = time.perf_counter()
                    try:
                        compiled = jax.jit(fn).lower(*inputs).compile()
                    except Exception as e:  # noqa: BLE001 — reported, the rest still run
                        failed.append(label.strip())
                        print(f"{label} FAILED: {type(e).__name__}: {str(e)[:800]}", flush=True)
                        continue
                    mem = compiled.memory_analysis()
                    temp = getattr(mem, "temp_size_in_bytes", 0) / 2**20 if mem else float("nan")
                    ratio = declared_flops(compiled.as_text()) / (products * 2 * M * K * N)
                    print(f"{label} compiled in {time.perf_counter() - t0:5.1f} s, temporaries "
                          f"{temp:7.1f} MiB per chip, declared/analytic FLOPs {ratio:.3f}", flush=True)
    print(f"{E} experts, {M} rows ({args.rows_per_expert} per expert)")
    if failed:
        sys.exit("failed: " + "; ".join(failed))


if __name__ == "__main__":
    main()
