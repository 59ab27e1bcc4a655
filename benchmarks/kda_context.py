"""Context-parallel KDA against one device: per-device temp memory and time, side by side.

    python benchmarks/kda_context.py [--T 16384] [--devices 2] [--H 8] [--K 128] [--C 64]

Runs `kda(impl=...)` on the whole sequence on one device, and `sharded_kda` with the time
axis split over `--devices` fake CPU devices (context_parallel_kda on each, holding
T / devices tokens), forward and gradient.
Prints XLA's per-device temp allocation of each compiled program and its best time. On
this 2-core machine each of two fake devices runs on its own core, but each makes two
passes over its half (the state map with V + K value columns, then the outputs), so the
time column shows that overhead against one device's single pass, not a pod's speed-up;
the memory column is what a pod gets per chip.
"""

from __future__ import annotations

import argparse
import os


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--T", type=int, default=16384)
    ap.add_argument("--devices", type=int, default=2)
    ap.add_argument("--B", type=int, default=1)
    ap.add_argument("--H", type=int, default=8)
    ap.add_argument("--K", type=int, default=128)
    ap.add_argument("--C", type=int, default=64)
    ap.add_argument("--impl", default="chunk")
    ap.add_argument("--reps", type=int, default=2)
    args = ap.parse_args()
    # Before JAX starts: the fake devices exist only if the flag is there at start-up.
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                               + f" --xla_force_host_platform_device_count={args.devices}")

    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding, PartitionSpec as P

    from k3jax.ops.kda import kda
    from k3jax.ops.kda_context import sharded_kda
    from kda import best_time, make_inputs  # benchmarks/kda.py, beside this file

    B, T, H, K, C = args.B, args.T, args.H, args.K, args.C
    x = [jnp.asarray(a) for a in make_inputs(B, T, H, K, K).values()]  # q, k, v, g, beta
    mesh = jax.make_mesh((args.devices,), ("context",),
                         axis_types=(jax.sharding.AxisType.Auto,))
    tok = P(None, "context")

    def whole(*a):
        return kda(*a, impl=args.impl, chunk_size=C)[0]

    def split(*a):
        return sharded_kda(*a, spec=tok, mesh=mesh, impl=args.impl, chunk_size=C)[0]

    print(f"B={B} T={T} H={H} K=V={K} C={C} impl={args.impl}; "
          f"context parallel over {args.devices} devices of {T // args.devices} tokens")
    rows = {}
    # The split program's inputs already in place, as a sharded training step has them.
    x_split = [jax.device_put(a, NamedSharding(mesh, tok)) for a in x]
    for name, f, xs in (("one device", whole, x), (f"context x{args.devices}", split, x_split)):
        for kind, fn in (("forward", f), ("gradient", jax.grad(
                lambda *a, f=f: jnp.sum(f(*a) ** 2), argnums=(0, 1, 2, 3, 4)))):
            c = jax.jit(fn).lower(*xs).compile()
            temp = c.memory_analysis().temp_size_in_bytes / 2**20
            secs = best_time(lambda c=c, xs=xs: c(*xs), args.reps)
            rows[name, kind] = (temp, secs)
            print(f"{name:12s} {kind:8s} temp {temp:8.0f} MiB per device  {secs * 1e3:8.0f} ms",
                  flush=True)
    cp = f"context x{args.devices}"
    for kind in ("forward", "gradient"):
        (m1, t1), (m2, t2) = rows["one device", kind], rows[cp, kind]
        print(f"{kind}: context / one device: memory {m2 / m1:.2f}x, time {t2 / t1:.2f}x")


if __name__ == "__main__":
    main()
