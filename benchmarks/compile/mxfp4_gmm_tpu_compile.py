"""Compile the MXFP4 grouped matmul's TPU path (the Pallas kernels through Mosaic) ahead of
time for a TPU generation, on a machine without one: forward and forward+backward (dx) of
K3's expert weights, w1/w3 [3072, 3584] and w2 [3584, 3072] in checkpoint orientation,
for one device's experts. Prints compile time and XLA's temporaries per chip.

    TPU-PYTHON benchmarks/compile/mxfp4_gmm_tpu_compile.py [--topology v4:2x2x1 v5e:2x2 ...]
        [--experts 8] [--rows-per-expert 512] [--dtypes bfloat16 float32] [--qat-rank 16]

TPU-PYTHON, what this host needs set for libtpu and what the compile checks:
benchmarks/compile/common.py. Mosaic's checks here include the layouts of the in-kernel
decode. Exits non-zero on failure.
"""
from __future__ import annotations

import argparse

import common
import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

common.repo_on_path()
from k3jax.ops.mxfp4_matmul import mxfp4_grouped_matmul  # noqa: E402


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
    common.add_topology_arg(ap)
    common.add_expert_args(ap, rows_per_expert=512)
    ap.add_argument("--qat-rank", type=int, default=0,
                    help="> 0: the quantization-aware kernels, with LoRA adapters of this rank")
    args = ap.parse_args()
    E, M = args.experts, args.experts * args.rows_per_expert
    failed = []
    for name, devices in common.tpu_topologies(args.topology):
        rep = NamedSharding(jax.sharding.Mesh(devices[:1], ("x",)), P())

        def sds(shape, dtype):
            return jax.ShapeDtypeStruct(shape, dtype, sharding=rep)

        # the weights as the checkpoint stores them: [out, in]
        for wname, (K, N) in common.expert_weights().items():
            for dtype in args.dtypes:
                inputs = (sds((M, K), jnp.dtype(dtype)), sds((E, N, K // 2), jnp.uint8),
                          sds((E, N, K // 32), jnp.uint8), sds((E,), jnp.int32))
                if args.qat_rank:
                    r = args.qat_rank
                    inputs += (sds((E, K, r), jnp.dtype(dtype)), sds((E, r, N), jnp.dtype(dtype)))
                for what, fn in programs().items():
                    common.compile_row(f"{name:10s} {wname:6s} [{N}, {K}] {dtype:9s} {what:11s}", fn, inputs, failed)
    print(common.experts_line(args))
    common.exit_if_failed(failed)


if __name__ == "__main__":
    main()
