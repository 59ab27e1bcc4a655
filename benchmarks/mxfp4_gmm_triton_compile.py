"""Compile the MXFP4 grouped matmul's Triton kernels for an NVIDIA GPU, without one: per
kernel the compile time, shared memory as a fraction of the GPU's limit, registers and
spills, at K3's expert shapes (w1/w3 [3072, 3584], w2 [3584, 3072], checkpoint
orientation), bf16 and fp32, both orientations.

    python benchmarks/mxfp4_gmm_triton_compile.py --triton-python /path/to/venv/bin/python \
        [--arch 90] [--num-warps 4] [--out DIR]

The same two stages as benchmarks/kda_triton_compile.py (see its docstring for why and
for the Triton Python): the kernels are lowered for CUDA here and their Triton IR written
to --out, then compiled by that script's `--compile` stage under --triton-python. Exits
non-zero if a kernel fails to compile or needs more shared memory than the GPU has.
"""
from __future__ import annotations

import argparse
import glob
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import kda_triton_compile as kda_compile  # noqa: E402  (benchmarks/kda_triton_compile.py)

WEIGHTS = {"w13": (3072, 3584), "w2": (3584, 3072)}


def dump_ttir(out, experts, rows):
    """Lower the forward and dx of every weight for CUDA; write each kernel's Triton IR as
    <weight>_<dtype>_<kernel>.ttir."""
    import jax
    import jax.numpy as jnp
    # Private: the lowering hands Triton bytecode to XLA; its text form is taken here.
    from jax._src.pallas.triton import pallas_call_registration as registration

    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from k3jax.ops.mxfp4_matmul import mxfp4_grouped_matmul

    seen = {}
    lower = registration.lowering.lower_jaxpr_to_triton_module
    tag = [""]

    def record(jaxpr, *args, **kw):
        result = lower(jaxpr, *args, **kw)
        text = result.module.operation.get_asm(enable_debug_info=False)
        seen[f"{tag[0]}_{jaxpr.debug_info.func_name}"] = text
        return result

    def fwd(x, p, s, g):
        return mxfp4_grouped_matmul(x, p, s, g, impl="pallas")

    def grad(x, p, s, g):
        return jax.grad(lambda x: jnp.sum(fwd(x, p, s, g).astype(jnp.float32) ** 2))(x)

    checks = [jax.export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")]
    registration.lowering.lower_jaxpr_to_triton_module = record
    try:
        for name, (N, K) in WEIGHTS.items():
            for dtype in (jnp.bfloat16, jnp.float32):
                tag[0] = f"{name}_{jnp.dtype(dtype).name}"
                args = (jax.ShapeDtypeStruct((experts * rows, K), dtype),
                        jax.ShapeDtypeStruct((experts, N, K // 2), jnp.uint8),
                        jax.ShapeDtypeStruct((experts, N, K // 32), jnp.uint8),
                        jax.ShapeDtypeStruct((experts,), jnp.int32))
                for fn in (fwd, grad):
                    jax.export.export(jax.jit(fn), platforms=["cuda"], disabled_checks=checks)(*args)
    finally:
        registration.lowering.lower_jaxpr_to_triton_module = lower
    os.makedirs(out, exist_ok=True)
    for old in glob.glob(os.path.join(out, "*.ttir")):
        os.remove(old)
    for name, text in seen.items():
        with open(os.path.join(out, f"{name}.ttir"), "w") as f:
            f.write(text)
    return sorted(glob.glob(os.path.join(out, "*.ttir")))


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--triton-python", required=True, help="a Python with the `triton` package installed")
    ap.add_argument("--arch", type=int, default=90, choices=sorted(kda_compile.SHARED_LIMIT),
                    help="compute capability (90: H100/H200)")
    ap.add_argument("--num-warps", type=int, default=4)
    ap.add_argument("--experts", type=int, default=8)
    ap.add_argument("--rows-per-expert", type=int, default=64)
    ap.add_argument("--out", default="/tmp/k3jax_mxfp4_gmm_ttir")
    args = ap.parse_args()
    paths = dump_ttir(args.out, args.experts, args.rows_per_expert)
    print(f"{len(paths)} kernels -> {args.out}; compiling for sm_{args.arch}, {args.num_warps} warps, "
          f"shared-memory limit {kda_compile.SHARED_LIMIT[args.arch] // 1024} KiB")
    kda_compile.run_compile(paths, args.triton_python, args.arch, args.num_warps)


if __name__ == "__main__":
    main()
