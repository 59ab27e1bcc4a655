"""Live param bytes with routed experts widened (bf16) or MXFP4-resident, side by side.

    python benchmarks/expert_bytes.py [--config toy] [--layers 5] [--experts 64]

Initialises the same model twice (same seed) with `expert_format` bf16 and mxfp4, bf16
params, and prints, from the arrays JAX holds live: bytes per routed-expert value (2 vs
17/32: an E2M1 nibble plus one E8M0 byte per 32), the expert stacks' and the whole model's
bytes, and their ratios. A LoRA-over-MXFP4 row adds rank-16 adapters on every default target.
"""
from __future__ import annotations

import argparse
import gc
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402

from k3jax.config import K3Config  # noqa: E402
from k3jax.model import LORA_KEY, abstract_params, init_params  # noqa: E402
from k3jax import lora  # noqa: E402
from k3jax.testing.variants import variant_dict  # noqa: E402


def live_bytes() -> int:
    return sum(x.nbytes for x in jax.live_arrays())


def expert_values_and_bytes(params) -> tuple[int, int]:
    values = nbytes = 0
    for path, x in jax.tree_util.tree_leaves_with_path(params):
        keys = [str(getattr(k, "key", k)) for k in path]
        if keys[0] == LORA_KEY or "block_sparse_moe" not in keys:
            continue
        if keys[-1] in ("w1", "w2", "w3"):
            values, nbytes = values + x.size, nbytes + x.nbytes
        elif keys[-2] in ("w1", "w2", "w3"):
            values += 2 * x.size if keys[-1] == "weight_packed" else 0
            nbytes += x.nbytes
    return values, nbytes


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--config", default="toy")
    ap.add_argument("--layers", type=int, default=5, help="decoder layers of the variant (0: the preset's)")
    ap.add_argument("--experts", type=int, default=64)
    a = ap.parse_args()
    over = {"num_experts": a.experts} if a.experts else {}
    layers = ("kda",) * (a.layers - 1) + ("mla",) if a.layers else None
    d = variant_dict(a.config, layers=layers, **over)
    d.pop("train", None)
    base = K3Config.from_hf(d).text.with_runtime(param_dtype="bfloat16", dtype="bfloat16")
    rows = []
    for name, cfg in (("bf16", base), ("mxfp4", base.with_runtime(expert_format="mxfp4"))):
        gc.collect()
        before = live_bytes()
        params = jax.block_until_ready(init_params(cfg, jax.random.PRNGKey(0)))
        total = live_bytes() - before
        values, nbytes = expert_values_and_bytes(params)
        rows.append((name, values, nbytes, total))
        del params
    cfg = base.with_runtime(expert_format="mxfp4")
    cfg = cfg.with_runtime(lora=lora.resolve({"rank": 16}, cfg, abstract_params(cfg)))
    gc.collect()
    before = live_bytes()
    params = jax.block_until_ready(init_params(cfg, jax.random.PRNGKey(0)))
    total = live_bytes() - before
    values, nbytes = expert_values_and_bytes(params)
    adapters = sum(x.nbytes for x in jax.tree.leaves(params[LORA_KEY]))
    rows.append(("mxfp4+lora16", values, nbytes, total))
    print(f"{a.config} variant: {cfg.num_hidden_layers} layers, {cfg.num_experts} experts "
          f"[{cfg.moe_hidden_size} x {cfg.moe_intermediate_size}], bf16 params")
    print(f"{'experts':<14}{'expert values':>15}{'expert bytes':>15}{'byte/value':>12}{'model bytes':>15}")
    for name, v, b, t in rows:
        print(f"{name:<14}{v:>15,d}{b:>15,d}{b / v:>12.4f}{t:>15,d}")
    (_, _, b16, t16), (_, _, b4, t4), (_, _, _, tl) = rows
    print(f"ratios mxfp4 / bf16: experts {b4 / b16:.4f} (17/64 = {17 / 64:.4f}), whole model {t4 / t16:.4f}; "
          f"LoRA rank 16 adds {adapters:,d} bytes ({adapters / t4:.3f} of the MXFP4 model)")


if __name__ == "__main__":
    main()
