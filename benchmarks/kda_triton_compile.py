"""Compile the Pallas KDA kernels with Triton for an NVIDIA GPU, without one: per kernel the
compile time, shared memory as a fraction of the GPU's limit, registers and spills.

    python benchmarks/kda_triton_compile.py --triton-python /path/to/venv/bin/python \
        [--K 128] [--C 64] [--arch 90] [--num-warps 4] [--out DIR]

A kernel that lowers (tests/ops/test_kda_engine.py exports them for CUDA) can still fail on the
device: XLA compiles its Triton IR there, and shared memory over the GPU's limit, or a
compile that takes many minutes, only shows then. This script finds both on a CPU machine.
It lowers pallas_kda (forward and gradient, with and without a gate bound) for CUDA here,
writes each kernel's Triton IR to --out, and compiles those files with the `triton` package
of another Python (`python -m venv tv && tv/bin/pip install triton`: keep it out of this
environment, where transformers would then dispatch to Triton and fail on CPU). Triton's
pass pipeline is the one XLA runs, though XLA bundles its own Triton version. Exits
non-zero if a kernel fails to compile or needs more shared memory than the GPU has.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time

# Shared memory one block may use, by compute capability (CUDA programming guide).
SHARED_LIMIT = {80: 163 * 1024, 86: 99 * 1024, 89: 99 * 1024, 90: 227 * 1024, 100: 227 * 1024}


def dump_ttir(out, K, C):
    """Lower pallas_kda for CUDA and write every Triton kernel's IR as <name>_<i>.ttir."""
    import functools

    import jax
    import jax.numpy as jnp
    # Private: the lowering hands Triton bytecode to XLA; its text form is taken here.
    from jax._src.pallas.triton import pallas_call_registration as registration

    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from pallas_kernels.kda import pallas_kda

    seen = {}
    lower = registration.lowering.lower_jaxpr_to_triton_module

    def record(jaxpr, *args, **kw):
        result = lower(jaxpr, *args, **kw)
        text = result.module.operation.get_asm(enable_debug_info=False)
        seen.setdefault(jaxpr.debug_info.func_name, {})[text] = None
        return result

    registration.lowering.lower_jaxpr_to_triton_module = record
    B, T, H = 1, 4 * C, 2
    f32 = lambda *s: jax.ShapeDtypeStruct(s, jnp.float32)  # noqa: E731
    args = (f32(B, T, H, K), f32(B, T, H, K), f32(B, T, H, K), f32(B, T, H, K), f32(B, T, H),
            f32(B, H, K, K), jax.ShapeDtypeStruct((B, T), jnp.bool_))
    checks = [jax.export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")]
    try:
        for lb in (None, -5.0):
            fwd = functools.partial(lambda lb, *a: pallas_kda(*a, C, gate_lower_bound=lb), lb)
            grad = jax.grad(lambda *a: sum(jnp.sum(y) for y in fwd(*a)), argnums=tuple(range(6)))
            for fn in (fwd, grad):
                jax.export.export(jax.jit(fn), platforms=["cuda"], disabled_checks=checks)(*args)
    finally:
        registration.lowering.lower_jaxpr_to_triton_module = lower
    os.makedirs(out, exist_ok=True)
    for name, texts in seen.items():
        for i, text in enumerate(texts):
            with open(os.path.join(out, f"{name}_{i}.ttir"), "w") as f:
                f.write(text)
    return sorted(glob.glob(os.path.join(out, "*.ttir")))


def compile_ttir(paths, arch, num_warps):
    """Runs under the Triton Python: compiles each file, one JSON line per kernel."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.backends.nvidia.compiler import get_ptxas

    for path in paths:
        t0 = time.perf_counter()
        try:
            # num_stages as pallas_kernels.kda.fwd.call_options sets it
            kernel = triton.compile(path, target=GPUTarget("cuda", arch, 32),
                                    options={"num_warps": num_warps, "num_stages": 1})
        except Exception as e:  # noqa: BLE001 — reported per kernel
            print(json.dumps({"path": path, "error": f"{type(e).__name__}: {str(e)[:500]}"}), flush=True)
            continue
        secs = time.perf_counter() - t0
        ptx = path[:-5] + ".ptx"
        with open(ptx, "w") as f:
            f.write(kernel.asm["ptx"])
        gpu = f"sm_{arch}a" if arch >= 90 else f"sm_{arch}"  # Triton targets the "a" variants
        log = subprocess.run([get_ptxas(arch).path, "-v", f"--gpu-name={gpu}", ptx, "-o", os.devnull],
                             capture_output=True, text=True).stderr
        regs = re.search(r"Used (\d+) registers", log)
        spills = re.search(r"(\d+) bytes spill stores", log)
        print(json.dumps({"path": path, "secs": secs, "shared": kernel.metadata.shared,
                          "registers": int(regs.group(1)) if regs else None,
                          "spill_bytes": int(spills.group(1)) if spills else None}), flush=True)


def run_compile(paths, triton_python, arch, num_warps):
    """Compile TTIR files under the Triton Python (this script's --compile stage) and print
    one line per kernel; exits non-zero on a failure or a kernel over the shared-memory limit.
    Also used by benchmarks/mxfp4_gmm_triton_compile.py."""
    # A fresh Triton cache: a cached kernel would report no compile time.
    cache = tempfile.mkdtemp(prefix="k3jax_triton_cache_")
    proc = subprocess.Popen([triton_python, os.path.abspath(__file__), "--compile", *paths,
                             "--arch", str(arch), "--num-warps", str(num_warps)],
                            stdout=subprocess.PIPE, text=True, env={**os.environ, "TRITON_CACHE_DIR": cache})
    bad = []
    for line in proc.stdout:
        r = json.loads(line)
        name = os.path.basename(r["path"])[:-5]
        if "error" in r:
            bad.append(name)
            print(f"{name:28s} FAILED {r['error']}")
            continue
        frac = r["shared"] / SHARED_LIMIT[arch]
        if frac > 1:
            bad.append(name)
        print(f"{name:28s} {r['secs']:7.1f} s  shared {r['shared'] // 1024:4d} KiB = {frac:.2f} of the "
              f"limit  {r['registers']} registers, {r['spill_bytes']} B spilled"
              + ("  OVER THE LIMIT" if frac > 1 else ""))
    proc.wait()
    shutil.rmtree(cache, ignore_errors=True)
    if proc.returncode != 0:
        sys.exit(f"the Triton Python failed (exit {proc.returncode})")
    if bad:
        sys.exit(f"do not fit or do not compile: {', '.join(bad)}")


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--triton-python", help="a Python with the `triton` package installed")
    ap.add_argument("--K", type=int, default=128, help="head dim (K = V), K3's is 128")
    ap.add_argument("--C", type=int, default=64, help="chunk size")
    ap.add_argument("--arch", type=int, default=90, choices=sorted(SHARED_LIMIT),
                    help="compute capability (90: H100/H200)")
    ap.add_argument("--num-warps", type=int, default=4)
    ap.add_argument("--out", default="/tmp/k3jax_kda_ttir")
    ap.add_argument("--compile", nargs="+", metavar="TTIR", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.compile:  # the second stage, under --triton-python
        return compile_ttir(args.compile, args.arch, args.num_warps)
    if not args.triton_python:
        ap.error("--triton-python is required (see the docstring)")
    paths = dump_ttir(args.out, args.K, args.C)
    print(f"{len(paths)} kernels (K = V = {args.K}, C = {args.C}) -> {args.out}; compiling for "
          f"sm_{args.arch}, {args.num_warps} warps, shared-memory limit "
          f"{SHARED_LIMIT[args.arch] // 1024} KiB")
    run_compile(paths, args.triton_python, args.arch, args.num_warps)


if __name__ == "__main__":
    main()
