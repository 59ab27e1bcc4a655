"""Lower the CLI's sharded train / prefill / decode steps for CUDA (`jax.export`) at the GPU
presets' own device counts, on this CPU machine: a sharding that cannot be partitioned or
lowered for GPUs fails here, before a cluster is booked. Prints one line per program.

    python benchmarks/compile/aot_gpu_lower.py [--config toy] [--presets h200x64 b300x16]
                                               [--modes train prefill decode] [--batch N] [--seq 64]

Each preset runs in its own subprocess with as many fake CPU devices as the preset has GPUs
(XLA_FLAGS=--xla_force_host_platform_device_count=N). tests/aot/test_compile_gpu.py lowers the
b300x8 steps in the test session's 8 devices; this covers the larger presets.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import time

import common

CHILD = r"""
import json, sys, time, jax
from k3jax.aot import gpu, programs
from k3jax.config import load_k3
from k3jax.plan import PlanOptions
config, preset, modes, batch, seq = sys.argv[1], sys.argv[2], sys.argv[3].split(","), int(sys.argv[4]), int(sys.argv[5])
k3 = load_k3(config)
devices = jax.devices()
for mode in modes:
    t = time.perf_counter()
    if mode == "train":
        with gpu.target("gpu"):
            p = programs.train_program(k3, preset, devices, PlanOptions(batch=batch, seq=seq, optimizer="muon"))
    else:
        opt = PlanOptions(mode="infer", batch=batch, seq=seq, prefill_chunk=seq)
        pre, p = programs.serve_programs(k3, preset, devices, opt, new_tokens=1 if mode == "decode" else None)
        p = programs.with_cache(p, pre.lower().compile())   # CPU compile: the caches' shardings
    ex = gpu.export(p)
    text = ex.mlir_module()
    print(json.dumps({"preset": preset, "mode": mode, "platforms": list(ex.platforms), "devices": ex.nr_devices,
                      "ragged_all_to_all": "ragged_all_to_all" in text, "mlir_chars": len(text),
                      "seconds": round(time.perf_counter() - t, 1)}), flush=True)
"""


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default="toy")
    ap.add_argument("--presets", nargs="+", default=["h200x64", "b300x16"])
    ap.add_argument("--modes", nargs="+", default=["train", "prefill", "decode"], choices=["train", "prefill", "decode"])
    ap.add_argument("--batch", type=int, default=None, help="global sequences (default: the preset's device count)")
    ap.add_argument("--seq", type=int, default=32)
    a = ap.parse_args()
    root = common.repo_on_path()
    from k3jax.mesh import load_preset
    failed = []
    for name in a.presets:
        devices = math.prod(load_preset(name).shape(None).values())
        env = dict(os.environ, XLA_FLAGS=f"--xla_force_host_platform_device_count={devices}", JAX_PLATFORMS="cpu",
                   PYTHONPATH=root)
        t = time.perf_counter()
        r = subprocess.run([sys.executable, "-c", CHILD, a.config, name, ",".join(a.modes), str(a.batch or devices),
                            str(a.seq)], capture_output=True, text=True, env=env)
        sys.stdout.write(r.stdout)
        if r.returncode:
            failed.append(name)
            print(json.dumps({"preset": name, "error": r.stderr[-2000:]}))
        print(f"{name}: {devices} devices, {time.perf_counter() - t:.0f} s", file=sys.stderr)
    print(f"lowered for cuda: {len(a.presets) - len(failed)} of {len(a.presets)} presets; failed {failed}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
