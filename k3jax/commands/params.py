"""`k3jax params CONFIG [--json]`: total and activated parameter counts, nothing allocated."""
from __future__ import annotations

import json


def register(sub):
    p = sub.add_parser("params", help="total and activated parameter counts (nothing allocated)")
    p.add_argument("config", help="preset name (k3, kimi_linear_48b, toy), YAML preset, config.json or a model "
                                     "directory (checkpoint, training run)")
    p.add_argument("--json", action="store_true", help="print one JSON object {total, active, ...}")
    p.set_defaults(fn=run)


def run(args) -> int:
    from k3jax.checkpoint.load import load_any_config
    from k3jax.param_count import count_params

    k3 = load_any_config(args.config)
    counts = count_params(k3.text, k3.layout)
    if args.json:
        print(json.dumps(counts))
    else:
        print(f"total     {counts['total']:>20,d}  ({counts['total'] / 1e9:,.2f} B)")
        print(f"activated {counts['active']:>20,d}  ({counts['active'] / 1e9:,.2f} B)")
        print(f"  routed experts {counts['routed_experts']:,d}; "
              f"embedding lookup {counts['embedding']:,d} (not activated)")
    return 0
