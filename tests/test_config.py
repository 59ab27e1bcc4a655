"""Config: real keys, presets, round trips, and errors that name the key."""
import copy
import json

import pytest
import yaml

from k3jax import config as C

from helpers import REFERENCE_CONFIG, need


def real_config():
    with open(need(REFERENCE_CONFIG)) as f:
        return json.load(f)


def test_k3_preset_is_the_released_config():
    with open(C.preset_path("k3")) as f:
        assert yaml.safe_load(f) == real_config()


@pytest.mark.parametrize("name", ["k3", "kimi_linear_48b", "toy"])
def test_presets_round_trip(name):
    with open(C.preset_path(name)) as f:
        d = yaml.safe_load(f)
    train = d.pop("train", {})  # k3jax's own section, never part of config.json
    assert C.K3Config.from_hf(d).to_hf() == d
    assert C.load_k3(name).train == train


def test_real_config_values():
    cfg = C.ModelConfig.from_hf(real_config())
    assert cfg.hidden_size == 7168 and cfg.num_hidden_layers == 93
    kinds = cfg.layer_kinds
    assert [i for i, k in enumerate(kinds) if k == "mla"] == list(range(3, 92, 4)) + [92]
    assert kinds.count("kda") == 69
    assert cfg.ffn_kinds[0] == "dense" and set(cfg.ffn_kinds[1:]) == {"moe"}
    assert cfg.gate_lower_bound == -5.0 and cfg.use_full_rank_gate
    assert cfg.max_attn_res_blocks == 8  # pushes at 0, 12, ..., 84
    assert cfg.moe_hidden_size == 3584 and cfg.shared_intermediate_size == 6144
    assert cfg.mla_cache_dim == 576


def test_kimi_linear_preset_switches_k3_extras_off():
    cfg = C.load("kimi_linear_48b")
    assert cfg.q_lora_rank is None and not cfg.mla_use_output_gate
    assert cfg.gate_lower_bound is None and not cfg.use_full_rank_gate
    assert cfg.hidden_act == "silu" and not cfg.use_attn_res and not cfg.use_latent_moe
    assert cfg.routed_scaling_factor == 2.446 and C.load_k3("kimi_linear_48b").layout == "kimi_linear"


def test_toy_preset_has_every_layer_kind():
    cfg = C.load("toy")
    assert {"kda", "mla"} <= set(cfg.layer_kinds) and {"dense", "moe"} <= set(cfg.ffn_kinds)
    pushes = [i for i in range(cfg.num_hidden_layers) if i % cfg.attn_res_block_size == 0]
    assert len(pushes) >= 2 and cfg.num_experts >= 8
    assert cfg.gate_lower_bound is not None and cfg.q_lora_rank and cfg.use_latent_moe


def _text(**changes):
    d = copy.deepcopy(real_config()["text_config"])
    lac = changes.pop("linear_attn_config", {})
    d["linear_attn_config"].update(lac)
    d.update(changes)
    return d


@pytest.mark.parametrize("changes, key", [
    ({"not_a_kimi_key": 1}, "not_a_kimi_key"),
    ({"linear_attn_config": {"kda_layers": [1, 2, 3, 4]}}, "kda_layers"),  # 4 is full attention too
    ({"linear_attn_config": {"full_attn_layers": [4, 8]}}, "linear_attn_config"),  # layers in neither list
    ({"linear_attn_config": {"kda_layers": [0, 1, 2]}}, "kda_layers"),  # lists are 1-based
    ({"num_key_value_heads": 7}, "num_key_value_heads"),
    ({"attn_res_block_size": 0}, "attn_res_block_size"),
    ({"num_experts_per_token": 1000}, "num_experts_per_token"),
    ({"linear_attn_config": {"bogus": 1}}, "bogus"),
    ({"hidden_act": "gelu"}, "hidden_act"),
    ({"hidden_size": 0}, "hidden_size"),
])
def test_bad_configs_name_the_key(changes, key):
    with pytest.raises(C.ConfigError, match=key):
        C.ModelConfig.from_hf(_text(**changes))


def test_missing_key_is_named():
    d = _text()
    del d["hidden_size"]
    with pytest.raises(C.ConfigError, match="hidden_size"):
        C.ModelConfig.from_hf(d)


def test_runtime_options_are_validated_and_hashable():
    cfg = C.load("toy")
    with pytest.raises(C.ConfigError, match="kda_impl"):
        cfg.with_runtime(kda_impl="fast")
    a, b = cfg.with_runtime(kda_impl="recurrent"), cfg.with_runtime(kda_impl="chunk")
    assert a != b and hash(a) != hash(b)  # jit caches on the config: runtime must distinguish


def test_unknown_preset_lists_presets():
    with pytest.raises(C.ConfigError, match="toy"):
        C.load("no_such_preset")


def test_transformers_restated_keys_are_checked():
    d = _text(linear_num_heads=96, qk_head_dim=192, layer_types=None)
    d.pop("layer_types")
    cfg = C.ModelConfig.from_hf(d)
    assert cfg.to_hf() == d
    with pytest.raises(C.ConfigError, match="linear_num_heads"):
        C.ModelConfig.from_hf(_text(linear_num_heads=32))


def test_extends_merges_partial_sections_and_refuses_duplicate_keys(tmp_path):
    """A preset that `extends:` another changes only the keys it names, at any depth; a key
    given twice in one YAML mapping is an error naming the line (PyYAML alone keeps the last)."""
    lora_only = tmp_path / "a.yaml"
    lora_only.write_text("extends: toy_lora\ntrain:\n  lora:\n    targets: ['*/self_attn/q_b_proj']\n")
    train = C.load_k3(lora_only).train
    parent = C.load_k3("toy_lora").train
    assert train["lora"] == {**parent["lora"], "targets": ["*/self_attn/q_b_proj"]}
    assert train["runtime"] == parent["runtime"] and train["steps"] == parent["steps"]

    text_only = tmp_path / "b.yaml"
    text_only.write_text("extends: toy\ntext_config:\n  num_experts: 16\n  linear_attn_config:\n    num_heads: 2\n")
    cfg, toy = C.load(text_only), C.load("toy")
    assert (cfg.num_experts, cfg.kda_num_heads) == (16, 2)
    assert (cfg.kda_layers, cfg.kda_head_dim, cfg.hidden_size) == (toy.kda_layers, toy.kda_head_dim, toy.hidden_size)

    for body, line in (("extends: toy\ntrain:\n  steps: 3\n  steps: 4\n", 4),
                       ("extends: toy\ntrain: {lora: {rank: 2, rank: 3}}\n", 2),
                       ("extends: toy\nextends: k3\n", 2)):
        dup = tmp_path / "dup.yaml"
        dup.write_text(body)
        with pytest.raises(C.ConfigError, match=rf"dup.yaml:{line}:\d+: .*given twice"):
            C.load_k3(dup)


def test_expert_role_names_the_routed_expert_weight_of_any_param_path():
    """One answer to "is this a routed expert?" for stacks, their MXFP4 parts and adapters,
    as strings or jax key paths; shared experts, the router and the latent projections are not."""
    import jax

    from k3jax.config import expert_role, load
    from k3jax.model import param_shapes
    for path, role in (("groups/sub_0/block_sparse_moe/w1", "w1"),
                       ("groups/sub_1/block_sparse_moe/w2/weight_packed", "w2"),
                       ("groups/sub_1/block_sparse_moe/w2/weight_scale", "w2"),
                       ("lora/groups/sub_0/block_sparse_moe/w3/lora_a", "w3"),
                       ("groups/sub_0/block_sparse_moe/shared_experts/up_proj/kernel", None),
                       ("groups/sub_0/block_sparse_moe/gate", None),
                       ("groups/sub_0/block_sparse_moe/routed_expert_up_proj/kernel", None),
                       ("layers_0/mlp/w1", None), ("w1", None)):
        assert expert_role(path) == role, path
    cfg = load("toy")
    leaves = jax.tree_util.tree_leaves_with_path(param_shapes(cfg))
    found = {jax.tree_util.keystr(p): expert_role(p) for p, _ in leaves if expert_role(p)}
    E = cfg.num_experts
    # the routed stacks are the leaves with E experts of [latent, hidden] or [hidden, latent]
    # (a layer axis first where layers are scanned)
    stacks = {jax.tree_util.keystr(p) for p, x in leaves if x.ndim >= 3 and x.shape[x.ndim - 3] == E}
    assert set(found) == stacks and sorted(set(found.values())) == ["w1", "w2", "w3"]
