"""Cached decode speed and cache size.

1. k3jax decode time per token at contexts 256, 2k and 16k, batch 1, for the toy hybrid
   (MLA layers read a latent buffer that grows with the context) and a KDA-only toy
   (constant state: the 16k / 256 ratio should stay ≤ 1.3×).
2. Cache bytes per token, measured from allocated caches, against SPEC.md's formula
   (MLA layers × (kv_lora + rope) values × dtype bytes), for the toy and, from abstract
   shapes only, for K3 in bf16; plus the constant per-sequence KDA state.
3. Side by side on one Kimi-Linear-style config (hidden 512, 8 layers: 6 KDA + 2 MLA,
   16 experts top-4, real 163,840-id vocabulary, fp32, batch 1, 256-token prompt):
   transformers' `KimiLinearForCausalLM` cached decode vs k3jax decode (target ≥ 2×).

The context is filled by writing random latents and setting the cached length: decode
cost depends only on shapes and lengths, not on the cached values, and prefilling 16k
tokens would take minutes on a shared CPU. `--prefill` fills it for real (chunked).

    python benchmarks/decode.py [--steps 20] [--prefill] [--skip-hf]
"""
from __future__ import annotations

import argparse
import copy
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

from k3jax import config as C
from k3jax.configfiles import read_json_or_dict
from k3jax.infer import caches
from k3jax.infer import generate as G
from k3jax.model import init_params

CONTEXTS = (256, 2048, 16384)


def toy_variants():
    toy = C.load("toy")
    kda_only = toy.replace(kda_layers=tuple(range(1, toy.num_hidden_layers + 1)), full_attn_layers=())
    return {"toy hybrid": toy, "toy KDA-only": kda_only}


def filled_cache(cfg, params, context: int, max_len: int, prefill: bool, seed=0):
    """A batch-1 cache holding `context` tokens."""
    if prefill:
        ids = np.random.default_rng(seed).integers(0, 256, (1, context), dtype=np.int32)
        return G.prefill(cfg, params, ids, max_len=max_len, chunk=1024)[1]
    cache = caches.init_cache(cfg, 1, max_len)
    keys = iter(jax.random.split(jax.random.PRNGKey(seed), 1000))

    def fill(path, x):   # plausible magnitudes; the KDA state of unit-norm keys is O(1)
        return (0.5 * jax.random.normal(next(keys), x.shape, jnp.float32)).astype(x.dtype)
    layers = jax.tree_util.tree_map_with_path(fill, cache.layers)
    return caches.Cache(layers, jnp.full((1,), context, jnp.int32))


def time_decode(cfg, params, cache, steps: int) -> float:
    """Median seconds per decode step (after one compiling step), greedy feedback."""
    tok = np.zeros((1,), np.int32)
    logits, cache = G._extend_jit(cfg, params, cache, jnp.asarray(tok)[:, None], jnp.ones((1,), jnp.int32))
    times = []
    for _ in range(steps):
        tok = jnp.argmax(logits, -1).astype(jnp.int32)
        t = time.perf_counter()
        logits, cache = G._extend_jit(cfg, params, cache, tok[:, None], jnp.ones((1,), jnp.int32))
        logits.block_until_ready()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def bench_contexts(steps: int, prefill: bool):
    print("== k3jax decode, batch 1, ms per token ==")
    for name, cfg in toy_variants().items():
        params = init_params(cfg, jax.random.PRNGKey(0))
        row = {}
        for ctx in CONTEXTS:
            cache = filled_cache(cfg, params, ctx, ctx + steps + 1, prefill)
            row[ctx] = time_decode(cfg, params, cache, steps)
        print(f"{name:14s} " + "  ".join(f"{c:>6d}: {s * 1e3:7.2f}" for c, s in row.items())
              + f"   16k/256 = {row[16384] / row[256]:.2f}x", flush=True)


def bench_cache_bytes():
    print("== cache bytes ==")
    toy = C.load("toy")
    L = 1024
    per_tok = (caches.cache_bytes(caches.init_cache(toy, 1, 2 * L)) - caches.cache_bytes(caches.init_cache(toy, 1, L))) / L
    print(f"toy (fp32): measured {per_tok:,.0f} B/token, SPEC formula {caches.spec_bytes_per_token(toy):,d} B/token "
          f"({toy.layer_kinds.count('mla')} MLA layers x {toy.mla_cache_dim} values x 4 B); "
          f"KDA state + conv tails {caches.spec_bytes_per_sequence(toy):,d} B/sequence")
    k3 = C.load("k3").with_runtime(dtype="bfloat16", param_dtype="bfloat16")
    shapes = lambda n: jax.eval_shape(lambda: caches.init_cache(k3, 1, n))  # noqa: E731
    per_tok = (caches.cache_bytes(shapes(2 * L)) - caches.cache_bytes(shapes(L))) / L
    const = caches.cache_bytes(shapes(L)) - L * per_tok
    print(f"K3 (bf16, abstract): measured {per_tok:,.0f} B/token, SPEC formula {caches.spec_bytes_per_token(k3):,d} "
          f"B/token (24 x 576 x 2 B); KDA {const / 2**20:,.1f} MiB/sequence "
          f"(formula {caches.spec_bytes_per_sequence(k3) / 2**20:,.1f} MiB: 69 x (6 MiB state + conv tails))", flush=True)


def kimi_linear_dict(vocab: int) -> dict:
    d = {k: v for k, v in read_json_or_dict(C.preset_path("kimi_linear_48b")).items() if k != "train"}
    d.update(hidden_size=512, intermediate_size=1024, moe_intermediate_size=256, num_hidden_layers=8,
             num_attention_heads=8, num_key_value_heads=8, kv_lora_rank=128, qk_nope_head_dim=64,
             qk_rope_head_dim=32, v_head_dim=64, num_experts=16, num_experts_per_token=4, vocab_size=vocab,
             dtype="float32")
    d["linear_attn_config"] = dict(d["linear_attn_config"], head_dim=64, num_heads=8,
                                   kda_layers=[1, 2, 3, 5, 6, 7], full_attn_layers=[4, 8])
    return d


def bench_vs_transformers(steps: int, prompt: int, vocab: int):
    import torch
    from transformers import KimiLinearConfig, KimiLinearForCausalLM

    d = kimi_linear_dict(vocab)
    cfg = C.ModelConfig.from_hf(copy.deepcopy(d))
    ids = np.random.default_rng(0).integers(0, 256, (1, prompt), dtype=np.int32)

    torch.manual_seed(0)
    model = KimiLinearForCausalLM(KimiLinearConfig(**copy.deepcopy(d))).eval()
    with torch.inference_mode():
        out = model(torch.from_numpy(ids).long(), use_cache=True)
        cache, tok = out.past_key_values, out.logits[:, -1:].argmax(-1)
        times = []
        for _ in range(steps):
            t = time.perf_counter()
            out = model(tok, past_key_values=cache, use_cache=True)
            cache, tok = out.past_key_values, out.logits[:, -1:].argmax(-1)
            times.append(time.perf_counter() - t)
    hf = statistics.median(times)

    params = init_params(cfg, jax.random.PRNGKey(0))
    _, kcache = G.prefill(cfg, params, ids, max_len=prompt + steps + 1)
    ours = time_decode(cfg, params, kcache, steps)
    print(f"== Kimi-Linear-style (hidden 512, 8 layers, 16 experts top-4, vocab {vocab:,d}), batch 1, "
          f"context {prompt} ==\ntransformers KimiLinearForCausalLM: {hf * 1e3:7.2f} ms/token (torch threads "
          f"{torch.get_num_threads()})\nk3jax decode:                      {ours * 1e3:7.2f} ms/token   "
          f"speed-up {hf / ours:.2f}x", flush=True)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--prefill", action="store_true", help="fill contexts by a real (chunked) prefill")
    ap.add_argument("--skip-hf", action="store_true")
    ap.add_argument("--vocab", type=int, default=163840)
    args = ap.parse_args()
    print(f"devices: {jax.devices()[0].platform} x{jax.device_count()}", flush=True)
    bench_cache_bytes()
    bench_contexts(args.steps, args.prefill)
    if not args.skip_hf:
        bench_vs_transformers(args.steps, 256, args.vocab)


if __name__ == "__main__":
    main()
