"""`k3jax forward [CONFIG]`: random-init forward pass with timings, the quickest smoke test."""
from __future__ import annotations

import time


def register(sub):
    p = sub.add_parser("forward", help="random-init forward pass with timings (toy smoke test)")
    p.add_argument("config", nargs="?", default="toy")
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--kda-impl", default="chunk", choices=["recurrent", "chunk"])
    p.add_argument("--moe-dispatch", default="ragged", choices=["dense", "ragged"])
    p.set_defaults(fn=run)


def run(args) -> int:
    import jax
    import numpy as np

    from k3jax.config import load
    from k3jax.model import forward, init_params, layer_plan

    cfg = load(args.config, kda_impl=args.kda_impl, moe_dispatch=args.moe_dispatch)
    plan = layer_plan(cfg)
    print(f"config {args.config}: {cfg.num_hidden_layers} layers ({cfg.layer_kinds.count('kda')} KDA, "
          f"{cfg.layer_kinds.count('mla')} MLA), {len(plan.head)} unrolled + {plan.n_groups} scanned groups "
          f"of {plan.group_size} + {len(plan.tail)} unrolled; devices: {jax.devices()[0].platform} "
          f"x{jax.device_count()}", flush=True)
    t = time.perf_counter()
    params = jax.block_until_ready(init_params(cfg, jax.random.PRNGKey(args.seed)))
    n = sum(x.size for x in jax.tree.leaves(params))
    print(f"init: {n:,d} params in {time.perf_counter() - t:.1f} s", flush=True)
    tokens = np.random.default_rng(args.seed).integers(0, cfg.vocab_size, (args.batch, args.seq), dtype=np.int32)
    t = time.perf_counter()
    logits = jax.block_until_ready(forward(cfg, params, tokens))
    first = time.perf_counter() - t
    t = time.perf_counter()
    for _ in range(args.repeats):
        logits = jax.block_until_ready(forward(cfg, params, tokens))
    step = (time.perf_counter() - t) / max(args.repeats, 1)
    print(f"forward [{args.batch}x{args.seq}]: compile+run {first:.1f} s, then {step * 1e3:.1f} ms "
          f"({args.batch * args.seq / step:,.0f} tokens/s); logits {tuple(logits.shape)}, "
          f"finite={bool(np.isfinite(logits).all())}")
    return 0
