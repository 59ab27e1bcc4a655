"""The `k3jax` command."""
from __future__ import annotations

import argparse
import json
import sys
import time


def _cmd_params(args) -> int:
    from k3jax.config import load_k3
    from k3jax.param_count import count_params

    k3 = load_k3(args.config)
    counts = count_params(k3.text, k3.layout)
    if args.json:
        print(json.dumps(counts))
    else:
        print(f"total     {counts['total']:>20,d}  ({counts['total'] / 1e9:,.2f} B)")
        print(f"activated {counts['active']:>20,d}  ({counts['active'] / 1e9:,.2f} B)")
        print(f"  routed experts {counts['routed_experts']:,d}; embedding lookup {counts['embedding']:,d} (not activated)")
    return 0


def _cmd_forward(args) -> int:
    """A random-init forward pass with timings: the quickest end-to-end smoke test."""
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
    params = init_params(cfg, jax.random.PRNGKey(args.seed))
    jax.block_until_ready(params)
    n = sum(x.size for x in jax.tree.leaves(params))
    print(f"init: {n:,d} params in {time.perf_counter() - t:.1f} s", flush=True)
    rng = np.random.default_rng(args.seed)
    tokens = rng.integers(0, cfg.vocab_size, (args.batch, args.seq), dtype=np.int32)
    t = time.perf_counter()
    logits = jax.block_until_ready(forward(cfg, params, tokens))
    first = time.perf_counter() - t
    t = time.perf_counter()
    for _ in range(args.repeats):
        logits = jax.block_until_ready(forward(cfg, params, tokens))
    step = (time.perf_counter() - t) / max(args.repeats, 1)
    toks = args.batch * args.seq
    print(f"forward [{args.batch}x{args.seq}]: compile+run {first:.1f} s, then {step * 1e3:.1f} ms "
          f"({toks / step:,.0f} tokens/s); logits {tuple(logits.shape)}, finite={bool(np.isfinite(logits).all())}")
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="k3jax", description="Kimi K3 in JAX")
    sub = ap.add_subparsers(dest="cmd", required=True)

    p = sub.add_parser("params", help="total and activated parameter counts (nothing allocated)")
    p.add_argument("config", help="preset name (k3, kimi_linear_48b, toy), YAML preset or config.json")
    p.add_argument("--json", action="store_true", help="print one JSON object {total, active, ...}")
    p.set_defaults(fn=_cmd_params)

    p = sub.add_parser("forward", help="random-init forward pass with timings (toy smoke test)")
    p.add_argument("config", nargs="?", default="toy")
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--kda-impl", default="chunk", choices=["recurrent", "chunk"])
    p.add_argument("--moe-dispatch", default="ragged", choices=["dense", "ragged"])
    p.set_defaults(fn=_cmd_forward)

    args = ap.parse_args(argv)
    from k3jax.config import ConfigError
    from k3jax.model import InputError
    try:
        return args.fn(args)
    except (ConfigError, InputError, FileNotFoundError) as e:
        print(f"k3jax {args.cmd}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
