"""Compile the Pallas KDA kernels with Triton for an NVIDIA GPU, without one: per kernel the
compile time, shared memory as a fraction of the GPU's limit, registers and spills.

    python benchmarks/compile/kda_triton_compile.py --triton-python /path/to/venv/bin/python \
        [--K 128] [--C 64] [--arch 90] [--num-warps 4] [--out DIR]

It lowers pallas_kda (forward and gradient, with and without K3's gate bound) for CUDA here,
as tests/ops/test_kda_engine.py does, writes each kernel's Triton IR to --out and compiles
those files under --triton-python. TRITON-PYTHON, the two stages and why: see
benchmarks/compile/common.py. Exits non-zero if a kernel fails to compile or needs more
shared memory than the GPU has.
"""

from __future__ import annotations

import argparse
import functools

import common


def dump_ttir(out, K, C):
    """Lower pallas_kda for CUDA and write every Triton kernel's IR as <name>_<i>.ttir."""
    import jax
    import jax.numpy as jnp

    common.repo_on_path()
    from pallas_kernels.kda import pallas_kda

    B, T, H = 1, 4 * C, 2
    f32 = lambda *s: jax.ShapeDtypeStruct(s, jnp.float32)  # noqa: E731
    args = (f32(B, T, H, K), f32(B, T, H, K), f32(B, T, H, K), f32(B, T, H, K), f32(B, T, H),
            f32(B, H, K, K), jax.ShapeDtypeStruct((B, T), jnp.bool_))
    with common.triton_kernels() as seen:
        for lb in (None, common.k3().gate_lower_bound):
            fwd = functools.partial(lambda lb, *a: pallas_kda(*a, C, gate_lower_bound=lb), lb)
            grad = jax.grad(lambda *a: sum(jnp.sum(y) for y in fwd(*a)), argnums=tuple(range(6)))
            for fn in (fwd, grad):
                common.export_cuda(fn, *args)
    texts = {}   # per kernel name, its distinct IRs in the order they lowered
    for name, text in seen:
        texts.setdefault(name, {})[text] = None
    return common.write_ttir(out, {f"{name}_{i}": text for name, ts in texts.items() for i, text in enumerate(ts)})


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    common.add_triton_args(ap)
    ap.add_argument("--K", type=int, default=128, help="head dim (K = V), K3's is 128")
    ap.add_argument("--C", type=int, default=64, help="chunk size")
    ap.add_argument("--out", default="/tmp/k3jax_kda_ttir")
    args = ap.parse_args()
    paths = dump_ttir(args.out, args.K, args.C)
    common.triton_compile(paths, args, detail=f" (K = V = {args.K}, C = {args.C})")


if __name__ == "__main__":
    main()
