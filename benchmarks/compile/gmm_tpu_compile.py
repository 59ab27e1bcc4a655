"""Compile the routed experts' grouped matmul (k3jax.ops.grouped_matmul, impl="pallas":
pallas_kernels.gmm through Mosaic) ahead of time for a TPU generation, on a machine
without one: forward, and forward+backward (dx through the same kernel, dW through tgmm)
at K3's expert shapes (w1/w3 [3584, 3072], w2 [3072, 3584], [in, out]) for one device's
experts. Prints compile time, XLA's temporaries per chip and the kernels' declared FLOPs
against the analytic count.

    TPU-PYTHON benchmarks/compile/gmm_tpu_compile.py [--topology v5p:2x2x1 v6e:2x2 ...]
        [--experts 8] [--rows-per-expert 512] [--dtypes bfloat16 float32]

TPU-PYTHON, what this host needs set for libtpu and what the compile checks:
benchmarks/compile/common.py. Mosaic's checks here include the transposed product of tgmm.
Exits non-zero on failure.
"""
from __future__ import annotations

import argparse
import re

import common
import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

common.repo_on_path()
from k3jax.ops.grouped_matmul import grouped_matmul  # noqa: E402


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
    common.add_topology_arg(ap)
    common.add_expert_args(ap, rows_per_expert=512)
    args = ap.parse_args()
    E, M = args.experts, args.experts * args.rows_per_expert
    failed = []
    for name, devices in common.tpu_topologies(args.topology):
        rep = NamedSharding(jax.sharding.Mesh(devices[:1], ("x",)), P())
        for wname, (K, N) in common.expert_weights().items():
            for dtype in args.dtypes:
                inputs = (jax.ShapeDtypeStruct((M, K), jnp.dtype(dtype), sharding=rep),
                          jax.ShapeDtypeStruct((E, K, N), jnp.dtype(dtype), sharding=rep),
                          jax.ShapeDtypeStruct((E,), jnp.int32, sharding=rep))
                for what, (fn, products) in programs().items():
                    analytic = products * 2 * M * K * N
                    common.compile_row(f"{name:10s} {wname:6s} [{K}, {N}] {dtype:9s} {what:10s}", fn, inputs, failed,
                                       extra=lambda c, analytic=analytic:
                                       f", declared/analytic FLOPs {declared_flops(c.as_text()) / analytic:.3f}")
    print(common.experts_line(args))
    common.exit_if_failed(failed)


if __name__ == "__main__":
    main()
