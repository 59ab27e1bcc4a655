"""What the dropless 'ep' exchange holds and does, side by side: capacity 1.25 (drops), one
worst-case round, and a first round of `ep_first_round` × the mean with overflow windows.

    python benchmarks/ep_rounds.py [--tokens 256 --hidden 512 --mesh expert8]

One MoE layer's forward + backward (`ops.moe_dispatch.experts_ep`, padded exchange) compiled
on 8 fake CPU devices; per form: XLA's temporaries (memory_analysis), and k3jax.aot's
balanced-routing totals of the compiled program (matmul FLOPs, HBM bytes: the overflow
windows counted out), each as a ratio to capacity 1.25's. The windows' claim: the balanced
step does the capacity step's work (issue: within 1.3×) and holds about one window beyond
it, where one worst-case round holds and does P× the mean.
"""
from __future__ import annotations

import argparse
import functools
import os
import sys

os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from k3jax.mesh import load_mesh, use_mesh  # noqa: E402
from k3jax.aot import hlo  # noqa: E402
from k3jax.config import load  # noqa: E402
from k3jax.layers.mlp import glu_activation  # noqa: E402
from k3jax.ops import moe_dispatch as md  # noqa: E402


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--experts", type=int, default=8)
    ap.add_argument("--mesh", default="expert8")
    args = ap.parse_args()
    E, H, F, k, N = args.experts, args.hidden, args.hidden // 2, 2, args.tokens
    r = np.random.default_rng(0)
    z = jnp.asarray(r.normal(size=(N, H)), jnp.float32)
    idx = jnp.asarray(np.stack([r.choice(E, k, replace=False) for _ in range(N)]), jnp.int32)
    w = jnp.asarray(r.random((N, k)), jnp.float32)
    w1, w3 = (jnp.asarray(r.normal(size=(E, H, F)), jnp.float32) for _ in range(2))
    w2 = jnp.asarray(r.normal(size=(E, F, H)), jnp.float32)
    mesh, rules = load_mesh(args.mesh)

    def loss(cfg, z, w, w1, w2, w3):
        y = md.experts_ep(cfg, functools.partial(glu_activation, cfg), z, idx, w, {"w1": w1, "w2": w2, "w3": w3}, {})
        return jnp.sum(jnp.sin(y))

    forms = [("capacity 1.25 (drops)", dict(ep_capacity_factor=1.25)), ("one worst-case round", {}),
             ("first 1.25 + windows", dict(ep_first_round=1.25)), ("first 0.5 + windows", dict(ep_first_round=0.5))]
    base = None
    print(f"{N} tokens, hidden {H}, {E} experts top-{k}, mesh {args.mesh}; ratios to capacity 1.25")
    for name, runtime in forms:
        cfg = load("toy", ep_exchange="padded", **runtime)
        with use_mesh(mesh, rules):
            c = jax.jit(jax.grad(functools.partial(loss, cfg), argnums=(0, 2, 3, 4))).lower(z, w, w1, w2, w3).compile()
        t = hlo.analyse(c.as_text())
        fig = (c.memory_analysis().temp_size_in_bytes, t.flops, t.hbm_bytes)
        base = base or fig
        print(f"  {name:<24} temporaries {fig[0] / 2**20:7.2f} MiB ({fig[0] / base[0]:.2f}x)  "
              f"FLOPs {fig[1] / base[1]:.2f}x  HBM bytes {fig[2] / base[2]:.2f}x")


if __name__ == "__main__":
    main()
