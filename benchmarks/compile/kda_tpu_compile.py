"""Compile KDA's TPU paths ahead of time for a TPU generation, on a machine without one:
the Pallas kernels through Mosaic and the XLA `chunk` path, forward and gradient, with and
without K3's gate bound, on one chip and context-parallel over all chips of the topology.
Prints compile time and XLA's temporary memory per chip for each program.

    TPU-PYTHON benchmarks/compile/kda_tpu_compile.py [--topology v5e:2x2 v6e:2x2 ...] [--T 8192]
                                                     [--H 8] [--K 128] [--C 64] [--impls pallas chunk]

TPU-PYTHON (the `[tpu]` venv), what this host needs set for libtpu and what the compile
checks: benchmarks/compile/common.py. Exits non-zero on failure.
"""

from __future__ import annotations

import argparse

import common
import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

common.repo_on_path()
from k3jax.ops.kda import kda  # noqa: E402
from k3jax.ops.kda_context import context_parallel_kda  # noqa: E402


def programs(impl, C, lb, mesh):
    """(forward, forward+backward) of one KDA layer: on one chip when mesh is None, else
    context-parallel over the mesh's `context` axis (the time axis split across chips)."""
    def one_chip(q, k, v, g, beta, h0):
        return kda(q, k, v, g, beta, initial_state=h0, output_final_state=True, impl=impl,
                   chunk_size=C, gate_lower_bound=lb)

    def local(q, k, v, g, beta, h0):
        return context_parallel_kda(q, k, v, g, beta, initial_state=h0, output_final_state=True,
                                    impl=impl, chunk_size=C, gate_lower_bound=lb)

    fwd = one_chip
    if mesh is not None:
        tok = P(None, "context")
        # the final state is replicated by construction (see context_parallel_kda)
        fwd = jax.shard_map(local, mesh=mesh, in_specs=(tok,) * 5 + (P(),), out_specs=(tok, P()),
                            check_vma=False)

    def loss(*x):
        o, h = fwd(*x)
        return jnp.sum(o.astype(jnp.float32)) + jnp.sum(h)

    return fwd, jax.grad(loss, argnums=tuple(range(6)))


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    common.add_topology_arg(ap)
    ap.add_argument("--T", type=int, default=8192)
    ap.add_argument("--H", type=int, default=8)
    ap.add_argument("--K", type=int, default=128, help="head dim (K = V)")
    ap.add_argument("--C", type=int, default=64, help="chunk size")
    ap.add_argument("--impls", nargs="+", default=["pallas", "chunk"], choices=("pallas", "chunk", "assoc"))
    args = ap.parse_args()
    T, H, K, C = args.T, args.H, args.K, args.C
    failed = []
    for name, devices in common.tpu_topologies(args.topology):
        layouts = [("1 chip", None)]
        if len(devices) > 1:
            layouts.append((f"context×{len(devices)}", jax.sharding.Mesh(devices, ("context",))))
        for where, mesh in layouts:
            m = mesh or jax.sharding.Mesh(devices[:1], ("context",))
            tok, rep = NamedSharding(m, P(None, "context")), NamedSharding(m, P())
            def sds(*shape, sh=tok, dtype=jnp.bfloat16):
                return jax.ShapeDtypeStruct(shape, dtype, sharding=sh)

            inputs = (sds(1, T, H, K), sds(1, T, H, K), sds(1, T, H, K), sds(1, T, H, K),
                      sds(1, T, H), sds(1, H, K, K, sh=rep, dtype=jnp.float32))
            for impl in args.impls:
                for lb in (None, common.k3().gate_lower_bound):
                    for what, fn in zip(("forward", "forward+backward"), programs(impl, C, lb, mesh)):
                        common.compile_row(f"{name:10s} {where:10s} {impl:6s} gate_lower_bound={str(lb):5s} "
                                           f"{what:16s}", fn, inputs, failed)
    print(f"B=1, T={T}, H={H}, K=V={K}, C={C}, bf16 inputs")
    common.exit_if_failed(failed)


if __name__ == "__main__":
    main()
