"""Compile the MXFP4 grouped matmul's Triton kernels for an NVIDIA GPU, without one: per
kernel the compile time, shared memory as a fraction of the GPU's limit, registers and
spills, at K3's expert shapes (w1/w3 [3072, 3584], w2 [3584, 3072], checkpoint
orientation), bf16 and fp32, both orientations.

    python benchmarks/compile/mxfp4_gmm_triton_compile.py --triton-python /path/to/venv/bin/python \
        [--arch 90] [--num-warps 4] [--out DIR]

The kernels are lowered for CUDA here, their Triton IR written to --out, then compiled under
--triton-python. TRITON-PYTHON, the two stages and why: see benchmarks/compile/common.py.
Exits non-zero if a kernel fails to compile or needs more shared memory than the GPU has.
"""
from __future__ import annotations

import argparse

import common


def dump_ttir(out, experts, rows):
    """Lower the forward and dx of every weight for CUDA; write each kernel's Triton IR as
    <weight>_<dtype>_<kernel>.ttir."""
    import jax
    import jax.numpy as jnp

    common.repo_on_path()
    from k3jax.ops.mxfp4_matmul import mxfp4_grouped_matmul

    def fwd(x, p, s, g):
        return mxfp4_grouped_matmul(x, p, s, g, impl="pallas")

    def grad(x, p, s, g):
        return jax.grad(lambda x: jnp.sum(fwd(x, p, s, g).astype(jnp.float32) ** 2))(x)

    kernels = {}
    with common.triton_kernels() as seen:
        # the weights as the checkpoint stores them: [out, in]
        for name, (K, N) in common.expert_weights().items():
            for dtype in (jnp.bfloat16, jnp.float32):
                tag = f"{name.replace('/w', '')}_{jnp.dtype(dtype).name}"   # w1/w3 -> w13, a file name
                args = (jax.ShapeDtypeStruct((experts * rows, K), dtype),
                        jax.ShapeDtypeStruct((experts, N, K // 2), jnp.uint8),
                        jax.ShapeDtypeStruct((experts, N, K // 32), jnp.uint8),
                        jax.ShapeDtypeStruct((experts,), jnp.int32))
                for fn in (fwd, grad):
                    start = len(seen)
                    common.export_cuda(fn, *args)
                    kernels.update((f"{tag}_{kernel}", text) for kernel, text in seen[start:])
    return common.write_ttir(out, kernels)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    common.add_triton_args(ap)
    common.add_expert_args(ap, rows_per_expert=64, dtypes=False)
    ap.add_argument("--out", default="/tmp/k3jax_mxfp4_gmm_ttir")
    args = ap.parse_args()
    paths = dump_ttir(args.out, args.experts, args.rows_per_expert)
    common.triton_compile(paths, args)


if __name__ == "__main__":
    main()
