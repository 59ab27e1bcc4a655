"""Compile KDA's TPU paths ahead of time for a TPU generation, on a machine without one:
the Pallas kernels through Mosaic and the XLA `chunk` path, forward and gradient, with and
without K3's gate bound, on one chip and context-parallel over all chips of the topology.
Prints compile time and XLA's temporary memory per chip for each program.

    TPU-PYTHON benchmarks/kda_tpu_compile.py [--topology v5e:2x2 v6e:2x2 ...] [--T 8192]
                                             [--H 8] [--K 128] [--C 64] [--impls pallas chunk]

TPU-PYTHON is a Python with `jax[tpu]` at this environment's JAX version (its libtpu holds
the TPU compiler); keep it apart from the CPU environment, where an installed libtpu makes
JAX look for a TPU at start-up. With the repository on PYTHONPATH, e.g.

    python -m venv tpuv
    tpuv/bin/pip install "jax[tpu]==$(python -c 'import jax; print(jax.__version__)')" flax pyyaml
    TPU_ACCELERATOR_TYPE=v5litepod-4 TPU_WORKER_HOSTNAMES=localhost PYTHONPATH=. \
        tpuv/bin/python benchmarks/kda_tpu_compile.py

(the two variables quiet libtpu's search for TPU hosts). Compiling is what Mosaic's checks
need — block tiling, VMEM limits (a kernel that needs more VMEM than the chip has fails
here) — so this finds what a pod would find at its first step. Exits non-zero on failure.
"""

from __future__ import annotations

import argparse
import functools
import os
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import topologies
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from k3jax.ops.kda import kda  # noqa: E402
from k3jax.ops.kda_context import context_parallel_kda  # noqa: E402


def programs(impl, C, lb, mesh):
    """(forward, forward+backward) of one KDA layer: on one chip when mesh is None, else
    context-parallel over the mesh's `context` axis (the time axis split across chips)."""
    def fwd(q, k, v, g, beta, h0):
        return kda(q, k, v, g, beta, initial_state=h0, output_final_state=True, impl=impl,
                   chunk_size=C, gate_lower_bound=lb)

    if mesh is not None:
        def local(q, k, v, g, beta, h0):
            return context_parallel_kda(q, k, v, g, beta, initial_state=h0, output_final_state=True,
                                        impl=impl, chunk_size=C, gate_lower_bound=lb)

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
    ap.add_argument("--topology", nargs="+", default=["v4:2x2x1", "v5e:2x2", "v5p:2x2x1", "v6e:2x2"])
    ap.add_argument("--T", type=int, default=8192)
    ap.add_argument("--H", type=int, default=8)
    ap.add_argument("--K", type=int, default=128, help="head dim (K = V)")
    ap.add_argument("--C", type=int, default=64, help="chunk size")
    ap.add_argument("--impls", nargs="+", default=["pallas", "chunk"], choices=("pallas", "chunk", "assoc"))
    args = ap.parse_args()
    T, H, K, C = args.T, args.H, args.K, args.C
    failed = []
    for name in args.topology:
        topology = topologies.get_topology_desc(topology_name=name, platform="tpu")
        devices = np.array(topology.devices)
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
                for lb in (None, -5.0):
                    for what, fn in zip(("forward", "forward+backward"), programs(impl, C, lb, mesh)):
                        label = f"{name:10s} {where:10s} {impl:6s} gate_lower_bound={str(lb):5s} {what:16s}"
                        t0 = time.perf_counter()
                        try:
                            compiled = jax.jit(fn).lower(*inputs).compile()
                        except Exception as e:  # noqa: BLE001 — reported, the rest still run
                            failed.append(label.strip())
                            print(f"{label} FAILED: {type(e).__name__}: {str(e)[:400]}", flush=True)
                            continue
                        mem = compiled.memory_analysis()
                        temp = getattr(mem, "temp_size_in_bytes", 0) / 2**20 if mem else float("nan")
                        print(f"{label} compiled in {time.perf_counter() - t0:5.1f} s, "
                              f"temporaries {temp:7.1f} MiB per chip", flush=True)
    print(f"B=1, T={T}, H={H}, K=V={K}, C={C}, bf16 inputs")
    if failed:
        sys.exit("failed: " + "; ".join(failed))


if __name__ == "__main__":
    main()
