"""What the ahead-of-time compile and device-check scripts of benchmarks/compile/ share.

  gmm_tpu_compile.py, mxfp4_gmm_tpu_compile.py, kda_tpu_compile.py
                    the Pallas kernels compiled through Mosaic for TPU topologies, on a
                    machine without a TPU (TPU-PYTHON below)
  kda_triton_compile.py, mxfp4_gmm_triton_compile.py
                    the Pallas kernels compiled with Triton for an NVIDIA GPU, on a machine
                    without one (TRITON-PYTHON below)
  aot_gpu_lower.py  the CLI's sharded steps lowered for CUDA at the GPU presets' device counts
  compile_depth.py  compile time of 93 layers against 13
  device_check.py   the one-command check for the first lent GPU or TPU

Each script's docstring gives its command line. Each puts the repository on sys.path
(`repo_on_path`), so it runs from a checkout as `python benchmarks/compile/NAME.py`.

TPU-PYTHON is the `[tpu]` environment of README "Compile for a pod": a separate venv with
`jax[tpu]` at this environment's JAX version, whose libtpu holds the TPU compiler. Keep it
apart from the CPU environment, where an installed libtpu makes JAX look for a TPU at
start-up:

    python -m venv /work/venv-tpu && /work/venv-tpu/bin/pip install -e ".[tpu]"
    /work/venv-tpu/bin/python benchmarks/compile/kda_tpu_compile.py

Nothing needs setting by hand: `tpu_topologies` sets what libtpu needs on a host without a
TPU (TPU_ACCELERATOR_TYPE, TPU_WORKER_HOSTNAMES and the rest, as `k3jax compile` does:
k3jax.aot.chips.host_environment) before it looks a topology up. Compiling is what Mosaic's
checks need (block tiling, layouts, VMEM limits: a kernel that needs more VMEM than the chip
has fails here), so these scripts find what a pod would find at its first step, and exit
non-zero on a failure.

TRITON-PYTHON is another Python with the `triton` package, kept out of this environment
(where transformers would then dispatch to Triton and fail on CPU):

    python -m venv tv && tv/bin/pip install triton

A kernel that lowers for CUDA can still fail on the device: XLA compiles its Triton IR there,
and shared memory over the GPU's limit, or a compile that takes many minutes, only shows
then. A Triton script finds both on a CPU machine in two stages: it lowers its kernels for
CUDA here and writes each kernel's Triton IR to --out (`triton_kernels`, `write_ttir`), then
`triton_compile` compiles those files under --triton-python (this module run as a script:
its top level imports the standard library only) and prints per kernel the compile time,
shared memory as a fraction of the GPU's limit, registers and spills. Triton's pass pipeline
is the one XLA runs, though XLA bundles its own Triton version. It exits non-zero if a kernel
fails to compile or needs more shared memory than the GPU has.
"""
from __future__ import annotations

import argparse
import contextlib
import functools
import glob
import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def repo_on_path() -> str:
    """Put the repository (ROOT) first on sys.path, so `k3jax` and `pallas_kernels` import
    from this checkout; returns ROOT."""
    if ROOT not in sys.path:
        sys.path.insert(0, ROOT)
    return ROOT


# -- compiling ------------------------------------------------------------------------------

def timed_compile(fn, *args):
    """(`jax.jit(fn)` lowered for `args` and compiled, the seconds both took)."""
    import jax
    t0 = time.perf_counter()
    compiled = jax.jit(fn).lower(*args).compile()
    return compiled, time.perf_counter() - t0


def temporaries_mib(compiled) -> float:
    """XLA's temporary memory per device of a compiled program, in MiB (nan if XLA gives no
    memory analysis)."""
    mem = compiled.memory_analysis()
    return getattr(mem, "temp_size_in_bytes", 0) / 2**20 if mem else float("nan")


def compile_row(label: str, fn, inputs, failed: list, extra=None):
    """Compile `fn` for `inputs` and print one row: `label`, the compile time and XLA's
    temporaries per chip, then `extra(compiled)` when given; on an error, `label` FAILED with
    the error, and `label` appended to `failed` (the other rows still run). The compiled
    program, or None."""
    try:
        compiled, seconds = timed_compile(fn, *inputs)
    except Exception as e:  # noqa: BLE001 — reported, the rest still run
        failed.append(label.strip())
        print(f"{label} FAILED: {type(e).__name__}: {str(e)[:800]}", flush=True)
        return None
    print(f"{label} compiled in {seconds:5.1f} s, temporaries {temporaries_mib(compiled):7.1f} MiB per chip"
          + (extra(compiled) if extra else ""), flush=True)
    return compiled


def exit_if_failed(failed: list) -> None:
    if failed:
        sys.exit("failed: " + "; ".join(failed))


# -- TPU topologies on this host --------------------------------------------------------------

TOPOLOGIES = ["v4:2x2x1", "v5e:2x2", "v5p:2x2x1", "v6e:2x2"]


def add_topology_arg(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--topology", nargs="+", default=TOPOLOGIES,
                    help="TPU topologies, CHIP:AxB[xC] (default: %(default)s)")


def tpu_topologies(names):
    """Yield (name, its devices as a numpy array) for each TPU topology name, libtpu set up
    first for a host without a TPU. Exits with one line when libtpu is missing (not
    TPU-PYTHON) or cannot lay a topology out."""
    if importlib.util.find_spec("libtpu") is None:
        sys.exit(f"{os.path.basename(sys.argv[0])} needs libtpu, the TPU compiler: run it with the "
                 "[tpu] venv's Python (benchmarks/compile/common.py says how to make it)")
    repo_on_path()
    import jax
    import numpy as np

    from k3jax.aot.chips import host_environment, topology_devices
    from k3jax.errors import ConfigError
    host_environment("tpu")
    jax.config.update("jax_platforms", os.environ["JAX_PLATFORMS"])   # jax read it at import
    for name in names:
        try:
            devices = topology_devices(name)
        except ConfigError as e:
            sys.exit(str(e))
        yield name, np.array(devices)


# -- K3 ---------------------------------------------------------------------------------------

@functools.lru_cache(maxsize=None)
def k3():
    """K3's model config (configs/k3.yaml, the released config): its shapes and gate bound."""
    repo_on_path()
    from k3jax.config import load
    return load("k3")


def expert_weights() -> dict:
    """K3's routed expert weights as {name: (in, out)}: w1 and w3 take the experts' hidden
    size to their intermediate size, w2 takes it back."""
    d, f = k3().moe_hidden_size, k3().moe_intermediate_size
    return {"w1/w3": (d, f), "w2": (f, d)}


def add_expert_args(ap: argparse.ArgumentParser, rows_per_expert: int, dtypes: bool = True) -> None:
    ap.add_argument("--experts", type=int, default=8, help="experts on the device")
    ap.add_argument("--rows-per-expert", type=int, default=rows_per_expert)
    if dtypes:
        ap.add_argument("--dtypes", nargs="+", default=["bfloat16", "float32"])


def experts_line(args) -> str:
    return f"{args.experts} experts, {args.experts * args.rows_per_expert} rows ({args.rows_per_expert} per expert)"


# -- Triton kernels for an NVIDIA GPU -------------------------------------------------------

# Shared memory one block may use, by compute capability (CUDA programming guide).
SHARED_LIMIT = {80: 163 * 1024, 86: 99 * 1024, 89: 99 * 1024, 90: 227 * 1024, 100: 227 * 1024}


def add_triton_args(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--triton-python", required=True,
                    help="a Python with the `triton` package installed (benchmarks/compile/common.py)")
    ap.add_argument("--arch", type=int, default=90, choices=sorted(SHARED_LIMIT),
                    help="compute capability (90: H100/H200)")
    ap.add_argument("--num-warps", type=int, default=4)


@contextlib.contextmanager
def triton_kernels():
    """Inside the block every Pallas kernel lowered for CUDA is recorded: yields a list that
    fills with (kernel name, Triton IR text), in the order they lower."""
    # Private: the lowering hands Triton bytecode to XLA; its text form is taken here.
    from jax._src.pallas.triton import pallas_call_registration as registration

    lower = registration.lowering.lower_jaxpr_to_triton_module
    seen = []

    def record(jaxpr, *args, **kw):
        result = lower(jaxpr, *args, **kw)
        seen.append((jaxpr.debug_info.func_name, result.module.operation.get_asm(enable_debug_info=False)))
        return result

    registration.lowering.lower_jaxpr_to_triton_module = record
    try:
        yield seen
    finally:
        registration.lowering.lower_jaxpr_to_triton_module = lower


def export_cuda(fn, *args) -> None:
    """Lower `jax.jit(fn)` for CUDA (`jax.export`), Triton kernels allowed."""
    import jax
    checks = [jax.export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")]
    jax.export.export(jax.jit(fn), platforms=["cuda"], disabled_checks=checks)(*args)


def write_ttir(out: str, kernels: dict) -> list:
    """Write {name: Triton IR} as OUT/<name>.ttir, replacing the .ttir files there; their
    paths, sorted."""
    os.makedirs(out, exist_ok=True)
    for old in glob.glob(os.path.join(out, "*.ttir")):
        os.remove(old)
    for name, text in kernels.items():
        with open(os.path.join(out, f"{name}.ttir"), "w") as f:
            f.write(text)
    return sorted(glob.glob(os.path.join(out, "*.ttir")))


def triton_compile(paths, args, detail: str = "") -> None:
    """Compile the .ttir files under args.triton_python (this module's second stage) for
    args.arch with args.num_warps and print one line per kernel; exits non-zero on a failure
    or a kernel over the shared-memory limit. `detail` follows the kernel count in the
    heading."""
    arch, num_warps = args.arch, args.num_warps
    print(f"{len(paths)} kernels{detail} -> {args.out}; compiling for sm_{arch}, {num_warps} warps, "
          f"shared-memory limit {SHARED_LIMIT[arch] // 1024} KiB")
    # A fresh Triton cache: a cached kernel would report no compile time.
    cache = tempfile.mkdtemp(prefix="k3jax_triton_cache_")
    proc = subprocess.Popen([args.triton_python, os.path.abspath(__file__), *paths,
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


def _compile_ttir(paths, arch: int, num_warps: int) -> None:
    """The second stage, under TRITON-PYTHON: compile each file, one JSON line per kernel."""
    try:
        import triton
    except ImportError:
        sys.exit(f"--triton-python {sys.executable} has no `triton` package (benchmarks/compile/common.py)")
    from triton.backends.compiler import GPUTarget
    from triton.backends.nvidia.compiler import get_ptxas

    for path in paths:
        t0 = time.perf_counter()
        try:
            # num_stages as the kernels' call options set it (pallas_kernels/kda/fwd.py,
            # pallas_kernels/mxfp4_gmm/triton.py)
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


if __name__ == "__main__":   # triton_compile's second stage, under TRITON-PYTHON
    ap = argparse.ArgumentParser(description="Compile Triton IR files for an NVIDIA GPU: one JSON line "
                                             "per kernel (run by common.triton_compile)")
    ap.add_argument("ttir", nargs="+")
    ap.add_argument("--arch", type=int, required=True)
    ap.add_argument("--num-warps", type=int, required=True)
    a = ap.parse_args()
    _compile_ttir(a.ttir, a.arch, a.num_warps)
