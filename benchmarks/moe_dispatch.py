"""Routed-expert throughput of the MoE dispatches on 8 fake CPU devices.

    python benchmarks/moe_dispatch.py [--tokens 4096 --experts 64 --top-k 8 --mesh expert8]

Toy width (latent 32, expert hidden 32) with many experts, inputs sharded over the mesh's
token axes. `dense` runs every expert on every token; `ragged` lets XLA partition the
sort + ragged_dot; `ep` is the shard_map with all-to-all. Prints tokens/s of the forward
and of forward + backward, and the ep/ragged ratio. CPU numbers compare algorithms (work
and data movement), not TPU/GPU speed: fake devices share the host's cores.
"""
from __future__ import annotations

import argparse
import functools
import os
import sys
import time

os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from flax import linen as nn  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec as P  # noqa: E402

from k3jax.mesh import load_mesh, use_mesh  # noqa: E402
from k3jax.config import load  # noqa: E402
from k3jax.layers.mlp import glu_activation  # noqa: E402
from k3jax.ops import moe_dispatch  # noqa: E402


def timed(fn, args, repeats: int) -> float:
    jax.block_until_ready(fn(*args))               # compile + warm up
    t = time.perf_counter()
    for _ in range(repeats):
        jax.block_until_ready(fn(*args))
    return (time.perf_counter() - t) / repeats


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--experts", type=int, default=64)
    ap.add_argument("--top-k", type=int, default=8)
    ap.add_argument("--latent", type=int, default=32)
    ap.add_argument("--hidden", type=int, default=32)
    ap.add_argument("--mesh", default="expert8")
    ap.add_argument("--repeats", type=int, default=5)
    a = ap.parse_args()

    cfg = load("toy")
    E, k, H, F, N = a.experts, a.top_k, a.latent, a.hidden, a.tokens
    r = np.random.default_rng(0)
    z = r.normal(size=(N, H)).astype(np.float32)
    idx = np.argsort(r.random((N, E)), axis=1)[:, :k].astype(np.int32)   # k distinct experts per token
    w = r.random((N, k)).astype(np.float32)
    w1, w3 = (r.normal(size=(E, H, F)).astype(np.float32) * H ** -0.5 for _ in range(2))
    w2 = r.normal(size=(E, F, H)).astype(np.float32) * F ** -0.5

    mesh, rules = load_mesh(a.mesh)
    tok = NamedSharding(mesh, P(nn.logical_to_mesh_axes(("batch",), rules)[0]))   # tokens as the model keeps them
    exp = NamedSharding(mesh, P("expert"))
    args = [jax.device_put(x, s) for x, s in ((z, tok), (idx, tok), (w, tok), (w1, exp), (w2, exp), (w3, exp))]
    print(f"{N} tokens, {E} experts top-{k}, latent {H}, expert hidden {F}, mesh {a.mesh} "
          f"{dict(mesh.shape)}, backend {jax.default_backend()}", flush=True)

    results = {}
    for name in ("dense", "ragged", "ep"):
        fn = functools.partial(moe_dispatch.DISPATCH[name], cfg, functools.partial(glu_activation, cfg))

        def fwd(z, idx, w, w1, w2, w3, fn=fn):
            return fn(z, idx, w, {"w1": w1, "w2": w2, "w3": w3}, {})

        def train(z, idx, w, w1, w2, w3, fn=fn):
            return jax.grad(lambda z, w1, w2, w3: jnp.sum(fn(z, idx, w, {"w1": w1, "w2": w2, "w3": w3}, {}) ** 2),
                            argnums=(0, 1, 2, 3))(z, w1, w2, w3)
        with use_mesh(mesh, rules):
            t_f = timed(jax.jit(fwd), args, a.repeats)
            t_b = timed(jax.jit(train), args, a.repeats)
        results[name] = (N / t_f, N / t_b)
        print(f"{name:>7}: forward {N / t_f:12,.0f} tokens/s   forward+backward {N / t_b:12,.0f} tokens/s",
              flush=True)
    ep, rg = results["ep"], results["ragged"]
    print(f"ep/ragged: forward {ep[0] / rg[0]:.2f}x, forward+backward {ep[1] / rg[1]:.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
