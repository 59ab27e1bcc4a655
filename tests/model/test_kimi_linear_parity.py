"""Parity with transformers' `KimiLinearForCausalLM` (pure-torch CPU path), built at test time.

A small random Kimi-Linear model is saved with `save_pretrained` and loaded with k3jax,
both from the safetensors directory and after `k3jax convert`; logits must agree in fp32.
"""
import os

import numpy as np
import pytest

from helpers import assert_logits_match, randomise_kimi_linear

torch = pytest.importorskip("torch", reason="parity extra absent: torch is not installed")
os.environ.setdefault("HF_HUB_OFFLINE", "1")  # the KDA kernels fall back to pure torch; never fetch
transformers = pytest.importorskip("transformers", reason="parity extra absent: transformers is not installed")
if not hasattr(transformers, "KimiLinearForCausalLM"):
    pytest.skip(f"transformers {transformers.__version__} has no KimiLinearForCausalLM (needs >= 5.17)",
                allow_module_level=True)

from k3jax.checkpoint.convert import convert  # noqa: E402
from k3jax.checkpoint.load import load_model_dir  # noqa: E402
from k3jax.model import forward  # noqa: E402

LINEAR_ATTN = {"kda_layers": [1, 2, 3, 5, 6], "full_attn_layers": [4, 7], "head_dim": 16, "num_heads": 4,
               "short_conv_kernel_size": 4}

# Keys transformers' KimiLinearConfig serialises on top of the released Kimi-Linear schema.
# Each restates another key (or a fixed default of the released model); the test checks
# that it agrees and drops it, so the file k3jax reads has the released keys only.
@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    torch.manual_seed(0)
    cfg = transformers.KimiLinearConfig(
        vocab_size=320, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=7,
        num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=16, q_lora_rank=None, qk_rope_head_dim=8,
        qk_nope_head_dim=16, v_head_dim=16, num_experts=8, num_experts_per_token=2, num_shared_experts=1,
        first_k_dense_replace=1, routed_scaling_factor=2.446, moe_renormalize=True, linear_attn_config=LINEAR_ATTN,
        max_position_embeddings=4096, tie_word_embeddings=False, pad_token_id=0, bos_token_id=1, eos_token_id=2,
        hidden_act="silu")
    model = transformers.KimiLinearForCausalLM(cfg).float().eval()
    randomise_kimi_linear(model)
    d = tmp_path_factory.mktemp("kimi_linear") / "hf"
    model.save_pretrained(d)  # its config.json is read as written, transformers' extra keys included
    tokens = np.random.default_rng(1).integers(3, cfg.vocab_size, (2, 70)).astype(np.int32)
    with torch.inference_mode():
        ref = model(torch.from_numpy(tokens).long()).logits.float().numpy()
    assert ref.std(axis=0).mean() > 0.1  # logits really depend on the input
    return d, tokens, ref


def test_transformers_writes_the_dense_layer_as_block_sparse_moe(saved):
    d, _, _ = saved
    from k3jax.checkpoint.safetensors_io import ShardedCheckpoint
    names = ShardedCheckpoint(d).keys()
    assert "model.layers.0.block_sparse_moe.gate_proj.weight" in names  # accepted alongside the released 'mlp'


@pytest.mark.slow
def test_logits_match_transformers_from_safetensors_and_orbax(saved, tmp_path):
    d, tokens, ref = saved
    k3, params = load_model_dir(d)
    assert k3.layout == "kimi_linear"
    assert_logits_match(np.asarray(forward(k3.text, params, tokens)), ref)

    convert(d, tmp_path / "orbax")
    k3, params = load_model_dir(tmp_path / "orbax")
    assert_logits_match(np.asarray(forward(k3.text, params, tokens)), ref)
