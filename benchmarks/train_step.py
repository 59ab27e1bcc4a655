"""Train-step speed: tokens/s at toy width and at hidden 512, an MFU proxy, and transformers'
KimiLinearForCausalLM forward+backward on the same Kimi-Linear-style config.

    python benchmarks/train_step.py [--batch 16] [--seq 512] [--reps 3] [--no-torch]

MFU proxy = achieved FLOP/s (6 · activated params · tokens/s) / this machine's dense fp32
matmul FLOP/s measured in the same run (target >= 0.25 at hidden >= 512). The matmul rate
is the best of its runs before and after the steps, so a busy moment cannot deflate the
denominator. Steps hold 8k tokens by default: with fewer, Per-Head Muon's Newton–Schulz
(a fixed cost per step, ~4 GFLOP per 512×512 matrix) outweighs the model's own FLOPs. The side-by-side
uses a `kimi_linear` config (K3 extras off: no AttnRes, no latent MoE, SiLU, softplus gate)
because that is what transformers implements; k3jax's number there is the full train step
(forward, backward, Per-Head Muon, Quantile Balancing), torch's is forward+backward only.
"""
from __future__ import annotations

import argparse
import time

import jax
import numpy as np

from k3jax.config import K3Config, ModelConfig
from k3jax.model import init_params
from k3jax.train import config as tconf, muon, step as tstep
from k3jax.train.loop import flops_per_token
from kda import dense_matmul_rate  # benchmarks/kda.py: best-of-5 2048² fp32 matmul
from k3jax.testing.variants import variant_dict


def kimi_linear_dict(hidden=512, layers=4, heads=8, vocab=32000) -> dict:
    """A Kimi-Linear-style config: [KDA, KDA, KDA, MLA]·n, dense layer 0, 8 experts top-2."""
    kinds = [(i + 1) % 4 == 0 for i in range(layers)]
    return {
        "model_type": "kimi_linear", "vocab_size": vocab, "hidden_size": hidden, "intermediate_size": 2 * hidden,
        "moe_intermediate_size": hidden // 2, "num_hidden_layers": layers, "num_attention_heads": heads,
        "num_key_value_heads": heads, "kv_lora_rank": hidden // 4, "q_lora_rank": None,
        "qk_rope_head_dim": 32, "qk_nope_head_dim": hidden // heads, "v_head_dim": hidden // heads,
        "num_experts": 8, "num_experts_per_token": 2, "num_shared_experts": 1, "first_k_dense_replace": 1,
        "routed_scaling_factor": 2.446, "moe_renormalize": True, "hidden_act": "silu", "rms_norm_eps": 1e-5,
        "max_position_embeddings": 4096, "tie_word_embeddings": False, "bos_token_id": 1, "eos_token_id": 2,
        "pad_token_id": 0,
        "linear_attn_config": {"kda_layers": [i + 1 for i, m in enumerate(kinds) if not m],
                               "full_attn_layers": [i + 1 for i, m in enumerate(kinds) if m],
                               "head_dim": hidden // heads, "num_heads": heads, "short_conv_kernel_size": 4},
    }


def bench_k3jax(cfg: ModelConfig, batch: int, seq: int, reps: int):
    tc = tconf.resolve({}, {"data": {"seq_len": seq, "batch_size": batch}})
    params = init_params(cfg, jax.random.PRNGKey(0))
    tx, groups = muon.build_optimizer(cfg, params, tc["optimizer"], 100)
    state = tstep.init_state(params, tx, groups)
    fn = tstep.make_train_step(cfg, tc, tx, groups)
    rng = np.random.default_rng(0)
    tokens = rng.integers(3, min(cfg.vocab_size, 256), (1, batch, seq + 1)).astype(np.int32)
    b = {"tokens": tokens[..., :-1], "targets": tokens[..., 1:], "segment_ids": np.ones((1, batch, seq), np.int32),
         "loss_mask": np.ones((1, batch, seq), np.float32)}
    t = time.perf_counter()
    state, m = fn(state, b)
    jax.block_until_ready(m["loss"])
    compile_s = time.perf_counter() - t
    best = float("inf")
    for _ in range(reps):
        t = time.perf_counter()
        state, m = fn(state, b)
        jax.block_until_ready(m["loss"])
        best = min(best, time.perf_counter() - t)
    fpt = flops_per_token(state.params, cfg.num_experts_per_token / cfg.num_experts)
    return batch * seq / best, fpt, compile_s


def bench_torch(d: dict, batch: int, seq: int, reps: int):
    import torch
    import transformers
    torch.set_num_threads(max(1, torch.get_num_threads()))
    lac = d["linear_attn_config"]
    cfg = transformers.KimiLinearConfig(**{k: v for k, v in d.items() if k not in ("model_type",)},)
    cfg.linear_attn_config = lac
    model = transformers.KimiLinearForCausalLM(cfg).float().train()
    x = torch.randint(3, 256, (batch, seq))
    def once(x):
        out = model(x, labels=x)
        out.loss.backward()
    once(x[:1, :64])  # warm-up on a slice: torch has no compile step, and a full step takes minutes
    best = float("inf")
    for _ in range(reps):
        t = time.perf_counter()
        once(x)
        best = min(best, time.perf_counter() - t)
    return batch * seq / best


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--no-torch", action="store_true")
    a = ap.parse_args()
    peak = dense_matmul_rate()
    print(f"devices: {jax.devices()[0].platform} x{jax.device_count()}; dense fp32 matmul {peak / 1e9:.1f} GFLOP/s")
    def k3_variant(**kw):
        d = variant_dict(**kw)
        d.pop("train", None)
        return K3Config.from_hf(d).text
    rows = [("toy (hidden 64, 13 K3 layers)", k3_variant()),
            ("K3-style hidden 512, 4 layers", k3_variant(
                layers=("kda", "kda", "kda", "mla"), hidden_size=512, intermediate_size=1024,
                moe_intermediate_size=256, routed_expert_hidden_size=256, head_dim=64, num_heads=8,
                num_attention_heads=8, q_lora_rank=128, kv_lora_rank=128, qk_nope_head_dim=64,
                qk_rope_head_dim=32, v_head_dim=64))]
    kl = kimi_linear_dict()
    rows.append(("Kimi-Linear-style hidden 512", ModelConfig.from_hf(kl)))
    jax_kl = None
    for name, cfg in rows:
        tps, fpt, comp = bench_k3jax(cfg, a.batch, a.seq, a.reps)
        peak = max(peak, dense_matmul_rate())
        mfu = tps * fpt / peak
        print(f"k3jax train step  {name:32s} {tps:10,.0f} tok/s  {tps * fpt / 1e9:7.2f} GFLOP/s  "
              f"MFU proxy {mfu:.3f} of {peak / 1e9:.0f} GFLOP/s  (compile {comp:.0f} s)", flush=True)
        jax_kl = tps
    if not a.no_torch:
        tt = bench_torch(kl, a.batch, a.seq, max(1, a.reps - 1))
        print(f"transformers fwd+bwd {'Kimi-Linear-style hidden 512':29s} {tt:10,.0f} tok/s   "
              f"k3jax / transformers = {jax_kl / tt:.2f}x")


if __name__ == "__main__":
    main()
