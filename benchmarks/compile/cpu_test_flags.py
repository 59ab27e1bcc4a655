"""XLA:CPU compile cost of candidate flags for the test suite, side by side.

The suite's time is mostly XLA:CPU compiling small programs that then run once
(tests/helpers.py FAST_COMPILE holds the flags it takes). This compiles the 13-layer toy's
loss-and-gradient program in fresh processes (XLA_FLAGS are read once, at start-up),
alternating the flag sets, and prints each set's median compile CPU seconds (all threads),
its ratio to the first set's, and how far its loss and gradient are from the first set's.

Measured on 2026-12-08 (jax 0.10.2, 2 cores): XLA:CPU's elemental fusion emitters took 1.48x
the compile CPU of its MLIR emitters on this program (49.5 s against 33.5 s), though 0.85x on
the five-layer toy's and 0.92x over the fast tier (452 s against 490 s of CPU): the suite's
large programs are most of its time, so it keeps the default emitters.

    python benchmarks/compile/cpu_test_flags.py [--repeats 3]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

import numpy as np

FLAG_SETS = {
    "level 1 (before)": "--xla_backend_optimization_level=1",
    "level 1 + elemental emitters": "--xla_backend_optimization_level=1 --xla_cpu_use_fusion_emitters=false",
}

CHILD = r"""
import json, time
import jax, jax.numpy as jnp, numpy as np
jax.config.update("jax_default_matmul_precision", "highest")
from k3jax.config import load
from k3jax.model import K3Model, init_params
cfg = load("toy")
params = init_params(cfg, jax.random.PRNGKey(0))
rng = np.random.default_rng(0)
tokens, targets = (jnp.asarray(rng.integers(0, cfg.vocab_size, (2, 64)), jnp.int32) for _ in range(2))

def loss(p):
    logits = K3Model(cfg).apply({"params": p}, tokens)
    return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits), targets[..., None], -1))

lowered = jax.jit(jax.value_and_grad(loss)).lower(params)
t = time.process_time()
compiled = lowered.compile()
cpu = time.process_time() - t
value, grads = compiled(params)
flat = np.concatenate([np.asarray(g, np.float64).ravel() for g in jax.tree.leaves(grads)])
np.save(__import__("sys").argv[1], flat)
print(json.dumps({"compile_cpu_s": cpu, "loss": float(value)}))
"""


def run(flags: str, out: str) -> dict:
    repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = {**os.environ, "XLA_FLAGS": flags, "JAX_PLATFORMS": "cpu",
           "PYTHONPATH": repo + os.pathsep + os.environ.get("PYTHONPATH", "")}
    env.pop("JAX_COMPILATION_CACHE_DIR", None)        # every compile from scratch
    proc = subprocess.run([sys.executable, "-c", CHILD, out], env=env, capture_output=True, text=True)
    if proc.returncode:
        sys.exit(f"{flags}: the child failed:\n{proc.stderr[-2000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    times = {name: [] for name in FLAG_SETS}
    with tempfile.TemporaryDirectory() as d:
        results = {}
        for r in range(args.repeats):
            for i, (name, flags) in enumerate(FLAG_SETS.items()):
                got = run(flags, os.path.join(d, f"{i}.npy"))
                times[name].append(got["compile_cpu_s"])
                results[name] = (got["loss"], np.load(os.path.join(d, f"{i}.npy")))
                print(f"round {r + 1}: {name}: {got['compile_cpu_s']:.1f} s", flush=True)
        first = next(iter(FLAG_SETS))
        loss0, grads0 = results[first]
        base = statistics.median(times[first])
        for name in FLAG_SETS:
            loss, grads = results[name]
            med = statistics.median(times[name])
            print(f"{name:32s} compile CPU {med:6.1f} s  ratio {med / base:.2f}  "
                  f"|loss - first| {abs(loss - loss0):.1e}  "
                  f"gradient rel-L2 from first {np.linalg.norm(grads - grads0) / np.linalg.norm(grads0):.1e}")


if __name__ == "__main__":
    main()
