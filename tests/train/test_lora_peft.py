"""An exported LoRA adapter in real PEFT (issue 33): a toy Kimi-Linear base built and saved by
transformers, a k3jax LoRA run over it (every default target: KDA and MLA projections, the
dense MLP, shared and routed experts, with Quantile Balancing moving the router biases),
`k3jax export --adapter`, then `PeftModel.from_pretrained` onto transformers'
KimiLinearForCausalLM of that base. Its logits must be the run's (k3jax's forward of the
run's own params), and every tensor of the file must have landed where it belongs: PEFT
reports none unexpected, and the merged model differs from the base by exactly the file's
B·A (and router), placed by transformers' module layout as stated here."""
import json
import os
import re
import subprocess
import sys

import numpy as np
import pytest
import yaml

from helpers import FAST_COMPILE, assert_logits_match, randomise_kimi_linear, rel_l2, rel_max

torch = pytest.importorskip("torch", reason="parity extra absent: torch is not installed")
os.environ.setdefault("HF_HUB_OFFLINE", "1")  # the KDA kernels fall back to pure torch; never fetch
transformers = pytest.importorskip("transformers", reason="parity extra absent: transformers is not installed")
peft = pytest.importorskip("peft", reason="parity extra absent: peft is not installed")
if not hasattr(transformers, "KimiLinearForCausalLM"):
    pytest.skip(f"transformers {transformers.__version__} has no KimiLinearForCausalLM (needs >= 5.17)",
                allow_module_level=True)

from k3jax.checkpoint.adapters import CONFIG_NAME, PEFT_PREFIX, WEIGHTS_NAME  # noqa: E402
from k3jax.checkpoint.load import load_model_dir  # noqa: E402
from k3jax.model import forward  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CORPUS = os.path.join(ROOT, "data", "corpus.txt")
MOE_I = 16          # the toy's moe_intermediate_size: gate_up_proj holds w1 then w3, MOE_I rows each


def _cli(*args, env):
    p = subprocess.run([sys.executable, "-m", "k3jax.cli", *args], env=env, cwd=ROOT, capture_output=True,
                       text=True, timeout=1200)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """(base dir, run dir, adapter dir, eval tokens): three layers (KDA with the dense MLP,
    KDA with MoE, MLA with MoE), two LoRA steps, its adapter."""
    d = tmp_path_factory.mktemp("lora_peft")
    cfg = transformers.KimiLinearConfig(
        vocab_size=320, hidden_size=32, intermediate_size=48, moe_intermediate_size=MOE_I, num_hidden_layers=3,
        num_attention_heads=2, num_key_value_heads=2, kv_lora_rank=16, q_lora_rank=None, qk_rope_head_dim=8,
        qk_nope_head_dim=16, v_head_dim=16, num_experts=4, num_experts_per_token=2, num_shared_experts=1,
        first_k_dense_replace=1, routed_scaling_factor=2.446, moe_renormalize=True,
        linear_attn_config={"kda_layers": [1, 2], "full_attn_layers": [3], "head_dim": 16, "num_heads": 2,
                            "short_conv_kernel_size": 4},
        max_position_embeddings=4096, tie_word_embeddings=False, bos_token_id=256, eos_token_id=257,
        pad_token_id=319, hidden_act="silu")
    torch.manual_seed(0)
    model = transformers.KimiLinearForCausalLM(cfg).float().eval()
    randomise_kimi_linear(model)
    base = d / "base"
    model.save_pretrained(base)
    train = {"steps": 2, "log_every": 1, "ckpt_every": 2, "sample_tokens": 0, "peak_tflops": 1.0,
             "init_from": str(base), "data": {"path": CORPUS, "seq_len": 32, "batch_size": 2},
             "optimizer": {"warmup_steps": 0, "schedule": "constant"},
             "lora": {"rank": 4, "alpha": 6.0, "expert_rank": 3, "lr": 0.05}}
    (d / "run.yaml").write_text(yaml.safe_dump({"extends": str(base / "config.json"), "train": train}))
    env = dict(os.environ, K3JAX_COMPILE_CACHE=str(d / "xla"), JAX_PLATFORMS="cpu", XLA_FLAGS=FAST_COMPILE)
    _cli("train", str(d / "run.yaml"), f"output_dir={d}", "run_name=run", env=env)
    _cli("export", str(d / "run"), str(d / "adapter"), "--adapter", env=env)
    tokens = np.random.default_rng(1).integers(0, 256, (2, 40)).astype(np.int32)
    return base, d / "run", d / "adapter", tokens


def _logits(model, tokens):
    with torch.inference_mode():
        return model(torch.from_numpy(tokens).long(), use_cache=False).logits.float().numpy()


def _base(base):
    return transformers.KimiLinearForCausalLM.from_pretrained(base, dtype=torch.float32).eval()


@pytest.mark.slow
def test_peft_gives_the_runs_logits(exported):
    base_dir, run, adapter, tokens = exported
    k3, params = load_model_dir(run, {"param_dtype": "float32", "dtype": "float32"})
    want = np.asarray(forward(k3.text, params, tokens))
    model = _base(base_dir)
    plain = _logits(model, tokens)
    peft_model = peft.PeftModel.from_pretrained(model, str(adapter)).eval()
    assert_logits_match(_logits(peft_model, tokens), want)
    assert rel_l2(plain, want) > 1e-2        # the adapter is what brings the base to the run


@pytest.mark.slow
def test_every_tensor_of_the_adapter_lands_in_peft(exported):
    base_dir, _, adapter, _ = exported
    from safetensors.numpy import load_file
    tensors = load_file(str(adapter / WEIGHTS_NAME))
    config = json.loads((adapter / CONFIG_NAME).read_text())
    assert config["modules_to_save"] == ["mlp.gate"]
    base_sd = {k: v.double().numpy() for k, v in _base(base_dir).state_dict().items()}

    # what the file says the model is, on transformers' parameters: the router module whole
    # (its frozen weight the base's own, its biases moved by Quantile Balancing), and W + B·A
    # for each adapted module, routed experts into their fused stacks
    want = {k: v.copy() for k, v in base_sd.items()}
    ab = {}
    for name, t in tensors.items():
        key = name.removeprefix(PEFT_PREFIX)
        if ".lora_" in key:
            mod, which = key.rsplit(".lora_", 1)
            ab.setdefault(mod, {})[which[0]] = t.astype(np.float64)
        else:
            assert re.fullmatch(r"model\.layers\.[12]\.mlp\.gate\.(weight|e_score_correction_bias)", key), key
            if key.endswith(".weight"):
                np.testing.assert_array_equal(t, base_sd[key], err_msg=key)
            else:
                assert np.abs(t - base_sd[key]).max() > 0, key
            want[key] = t.astype(np.float64)
    assert len(tensors) == 2 * len(ab) + 4
    for mod, x in ab.items():
        d = x["B"] @ x["A"]
        assert np.abs(d).max() > 0, mod
        expert = re.fullmatch(r"(.*)\.block_sparse_moe\.experts\.(\d+)\.(w[123])", mod)
        if expert is None:
            mod = mod.replace(".block_sparse_moe.", ".mlp.").replace(".self_attn.f_", ".self_attn.forget_gate.f_")
            want[f"{mod}.weight"] += d
        elif expert[3] == "w2":
            want[f"{expert[1]}.mlp.experts.down_proj"][int(expert[2])] += d
        else:
            rows = slice(0, MOE_I) if expert[3] == "w1" else slice(MOE_I, 2 * MOE_I)
            want[f"{expert[1]}.mlp.experts.gate_up_proj"][int(expert[2]), rows] += d
    assert any(".forget_gate." in k and not np.array_equal(want[k], base_sd[k]) for k in want)

    model = peft.PeftModel.from_pretrained(_base(base_dir), str(adapter))
    # loaded again by hand to see PEFT's own account: nothing in the file left over, no
    # adapter parameter of the model left unfilled
    result = peft.set_peft_model_state_dict(model, peft.load_peft_weights(str(adapter), device="cpu"))
    assert not result.unexpected_keys, result.unexpected_keys
    assert not [k for k in result.missing_keys if ".lora_" in k or "modules_to_save" in k], result.missing_keys
    merged = {k: v.double().numpy() for k, v in model.merge_and_unload().state_dict().items()}
    assert merged.keys() == want.keys()
    for k, w in want.items():
        assert rel_max(merged[k], w) <= 1e-6, (k, rel_max(merged[k], w))
