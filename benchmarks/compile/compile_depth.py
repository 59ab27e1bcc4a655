"""Compile time vs depth: 93 layers vs 13 at toy width (target ratio ≤ 1.5×).

Both models have K3's layer pattern (dense layer 0, [KDA, KDA, KDA, MLA] groups, a final
MLA) so only the number of scanned groups differs: 22 vs 2. Compile times are measured
side by side in one process, alternating, and the median ratio is printed.

    python benchmarks/compile/compile_depth.py [--repeats 3]
"""
from __future__ import annotations

import argparse
import statistics

import common
import jax
import jax.numpy as jnp

common.repo_on_path()
from k3jax import config as C  # noqa: E402
from k3jax.layout import layer_plan  # noqa: E402
from k3jax.model import K3Model  # noqa: E402


def k3_pattern(layers: int) -> C.ModelConfig:
    toy = C.load("toy")
    full = tuple(i for i in range(4, layers, 4)) + (layers,)
    kda = tuple(i for i in range(1, layers + 1) if i not in full)
    return toy.replace(num_hidden_layers=layers, kda_layers=kda, full_attn_layers=full,
                       attn_res_block_size=12)


def compile_seconds(cfg: C.ModelConfig, seq: int) -> float:
    params = jax.eval_shape(lambda: K3Model(cfg).init(jax.random.PRNGKey(0), jnp.zeros((1, seq), jnp.int32)))
    return common.timed_compile(lambda p, t: K3Model(cfg).apply(p, t), params,
                                jax.ShapeDtypeStruct((1, seq), jnp.int32))[1]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--seq", type=int, default=128)
    args = ap.parse_args()
    shallow, deep = k3_pattern(13), k3_pattern(93)
    for name, cfg in (("13", shallow), ("93", deep)):
        p = layer_plan(cfg)
        print(f"{name} layers: {len(p.head)} unrolled + {p.n_groups} scanned groups of {p.group_size} "
              f"+ {len(p.tail)} unrolled")
    ratios, t13s, t93s = [], [], []
    for r in range(args.repeats):
        jax.clear_caches()
        t13 = compile_seconds(shallow, args.seq)
        jax.clear_caches()
        t93 = compile_seconds(deep, args.seq)
        t13s.append(t13), t93s.append(t93), ratios.append(t93 / t13)
        print(f"run {r}: compile 13 layers {t13:.2f} s, 93 layers {t93:.2f} s, ratio {t93 / t13:.3f}", flush=True)
    print(f"median compile: 13 layers {statistics.median(t13s):.2f} s, 93 layers {statistics.median(t93s):.2f} s; "
          f"ratio 93/13 = {statistics.median(ratios):.3f} (target <= 1.5)")


if __name__ == "__main__":
    main()
