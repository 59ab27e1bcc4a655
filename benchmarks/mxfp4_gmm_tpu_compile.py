"""Compile the MXFP4 grouped matmul's TPU path (the Pallas kernels through Mosaic) ahead of
time for a TPU generation, on a machine without one: forward and forward+backward (dx) of
K3's expert weights, w1/w3 [3072, 3584] and w2 [3584, 3072] in checkpoint orientation,
for one device's experts. Prints compile time and XLA's temporaries per chip.

    TPU-PYTHON benchmarks/mxfp4_gmm_tpu_compile.py [--topology v4:2x2x1 v5e:2x2 ...]
        [--experts 8] [--rows-per-expert 512] [--dtypes bfloat16 float32] [--qat-rank 16]

TPU-PYTHON as for benchmarks/kda_tpu_compile.py (a Python with `jax[tpu]` at this
environment's JAX version, the repository on PYTHONPATH, TPU_ACCELERATOR_TYPE and
TPU_WORKER_HOSTNAMES set). Compiling is what Mosaic's checks need (block tiling, the
layouts of the in-kernel decode, VMEM limits), so this finds what a pod would find at its
first step. Exits non-zero on failure.
"""
from __future__ import annotations

import argparse
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
from k3jax.ops.mxfp4_matmul import mxfp4_grouped_matmul  # noqa: E402

# K3's routed expert weights as the checkpoint stores them: [out, in].
WEIGHTS = {"w1/w3": (3072, 3584), "w2": (3584, 3072)}


def programs():
    """Programs over (x, packed, scale, sizes[, A, B]): with A and B the quantization-aware
    kernels (each tile merged with s·(A B)ᵀ and re-quantized: k3jax.ops.qat)."""
    def fwd(x, packed, scale, sizes, *ad):
        merge = (*ad, 2.0) if ad else None
        return mxfp4_grouped_matmul(x, packed, scale, sizes, impl="pallas", merge=merge)

    def loss(x, packed, scale, sizes, *ad):
        return jnp.sum(fwd(x, packed, scale, sizes, *ad).astype(jnp.float32) ** 2)  # needs y: both kernels run

    return {"forward": fwd, "forward+dx": jax.grad(loss)}


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--topology", nargs="+", default=["v4:2x2x1", "v5e:2x2", "v5p:2x2x1", "v6e:2x2"])
    ap.add_argument("--experts", type=int, default=8, help="experts on the device")
    ap.add_argument("--rows-per-expert", type=int, default=512)
    ap.add_argument("--dtypes", nargs="+", default=["bfloat16", "float32"])
    ap.add_argument("--qat-rank", type=int, default=0,
                    help="> 0: the quantization-aware kernels, with LoRA adapters of this rank")
    args = ap.parse_args()
    E, M = args.experts, args.experts * args.rows_per_expert
    failed = []
    for name in args.topology:
        topology = topologies.get_topology_desc(topology_name=name, platform="tpu")
        mesh = jax.sharding.Mesh(np.array(topology.devices[:1]), ("x",))
        rep = NamedSharding(mesh, P())

        def sds(shape, dtype):
            return jax.ShapeDtypeStruct(shape, dtype, sharding=rep)

        for wname, (N, K) in WEIGHTS.items():
            for dtype in args.dtypes:
                inputs = (sds((M, K), jnp.dtype(dtype)), sds((E, N, K // 2), jnp.uint8),
                          sds((E, N, K // 32), jnp.uint8), sds((E,), jnp.int32))
                if args.qat_rank:
                    r = args.qat_rank
                    inputs += (sds((E, K, r), jnp.dtype(dtype)), sds((E, r, N), jnp.dtype(dtype)))
                for what, fn in programs().items():
                    label = f"{name:10s} {wname:6s} [{N}, {K}] {dtype:9s} {what:11s}"
                    t0 = time.perf_counter()
                    try:
                        compiled = jax.jit(fn).lower(*inputs).compile()
                    except Exception as e:  # noqa: BLE001 — reported, the rest still run
                        failed.append(label.strip())
                        print(f"{label} FAILED: {type(e).__name__}: {str(e)[:600]}", flush=True)
                        continue
                    mem = compiled.memory_analysis()
                    temp = getattr(mem, "temp_size_in_bytes", 0) / 2**20 if mem else float("nan")
                    print(f"{label} compiled in {time.perf_counter() - t0:5.1f} s, "
                          f"temporaries {temp:7.1f} MiB per chip", flush=True)
    print(f"{E} experts, {M} rows ({args.rows_per_expert} per expert)")
    if failed:
        sys.exit("failed: " + "; ".join(failed))


if __name__ == "__main__":
    main()
