"""The train config is validated as a whole: every bad value is an error naming its key
(and, for enums, the allowed values); nothing is silently accepted or reinterpreted."""
import math
import re

import pytest

from k3jax.config import ConfigError
from k3jax.train import config as tconf


def resolve(*overrides, section=None):
    return tconf.resolve(section or {}, tconf.parse_overrides(list(overrides)))


@pytest.mark.parametrize("override, message", [
    ("optimizer.schedule=linear", "train.optimizer.schedule: 'linear' is not one of 'cosine', 'constant'"),
    ("optimizer.schedule=bogus", "train.optimizer.schedule: 'bogus' is not one of"),
    ("runtime.remat=some", "train.runtime.remat: 'some' is not one of 'none', 'full', 'dots'"),
    ("runtime.moe_dispatch=fast", "train.runtime.moe_dispatch: 'fast' is not one of 'auto', 'dense', 'ragged', 'ep'"),
    ("runtime.kda_impl=naive",
     "train.runtime.kda_impl: 'naive' is not one of 'auto', 'recurrent', 'chunk', 'assoc', 'pallas'"),
    ("runtime.ep_exchange=fast", "train.runtime.ep_exchange: 'fast' is not one of 'auto', 'padded', 'ragged'"),
    ("runtime.scan_layers=1", "train.runtime.scan_layers: expected true or false, got 1"),
    ("runtime.attention_q_block=-1", "train.runtime.attention_q_block: must be >= 0"),
    ("runtime.param_dtype=fp8", "train.runtime.param_dtype: 'fp8' is not one of"),
    ("data.tokenizer=sentencepiece", "train.data.tokenizer: 'sentencepiece' is not one of 'auto', 'byte', 'tiktoken'"),
    ("data.format=xml", "train.data.format: 'xml' is not one of 'text', 'chat'"),
    ("data.chat.train_on=first", "train.data.chat.train_on: 'first' is not one of 'all', 'last'"),
    ("data.chat.truncate=1", "train.data.chat.truncate: expected true or false, got 1"),
    ("data.chat.bogus=1", "train.data.chat.bogus: unknown key"),
    ("runtime.expert_format=fp8", "train.runtime.expert_format: 'fp8' is not one of 'bf16', 'mxfp4'"),
    ("lora.rank=-1", "train.lora.rank: must be >= 0, got -1"),
    ("lora.rank=true", "train.lora.rank: expected an integer, got True"),
    ("lora.alpha=0", "train.lora.alpha: must be > 0"),
    ("lora.expert_mode=tied", "train.lora.expert_mode: 'tied' is not one of 'per_expert', 'shared_a'"),
    ("lora.optimizer=sgd", "train.lora.optimizer: 'sgd' is not one of 'adamw', 'muon'"),
    ("lora.targets=q_proj", "train.lora.targets: expected a list, got 'q_proj'"),
    ("balance.method=greedy", "train.balance.method: 'greedy' is not one of 'auto', 'exact', 'hist'"),
    ("seed=abc", "train.seed: expected an integer, got 'abc'"),
    ("steps=true", "train.steps: expected an integer, got True"),          # bool is not an int
    ("data.batch_size=2.0", "train.data.batch_size: expected an integer, got 2.0"),
    ("async_checkpoint=1", "train.async_checkpoint: expected true or false, got 1"),
    ("optimizer.lr=-0.01", "train.optimizer.lr: must be >= 0, got -0.01"),
    ("optimizer.adam_lr=-1", "train.optimizer.adam_lr: must be >= 0"),
    ("optimizer.lr=true", "train.optimizer.lr: expected a number, got True"),
    ("optimizer.lr=fast", "train.optimizer.lr: expected a number, got 'fast'"),
    ("optimizer.b2=1.0", "train.optimizer.b2: must be >= 0 and < 1"),
    ("optimizer.min_lr_ratio=2", "train.optimizer.min_lr_ratio: must be >= 0 and <= 1"),
    ("optimizer.freeze=[re:(]", "train.optimizer.freeze: 're:(' is not a valid regular expression"),
    ("data.seq_len=1", "train.data.seq_len: must be >= 2"),
    ("keep=0", "train.keep: must be >= 1"),
    ("run_name=..", "train.run_name: must be a plain name"),
    ("run_name=../elsewhere", "train.run_name: must be a plain name"),
    ("run_name=a/b", "train.run_name: must be a plain name"),
    ("run_name=.hidden", "train.run_name: must be a plain name"),
    ("output_dir=runs/../../etc", "train.output_dir: must not contain '..'"),
    ("output_dir=gs://", "train.output_dir: a URL needs a bucket"),
    ("bogus=1", "train.bogus: unknown key"),
    ("optimizer.lrr=1", "train.optimizer.lrr: unknown key (known: adam_lr, b1, b2"),
    ("optimizer=3", "train.optimizer: expected a mapping, got 3"),
])
def test_bad_values_are_refused_naming_the_key(override, message):
    with pytest.raises(ConfigError) as e:
        resolve(override)
    assert message in str(e.value) and "\n" not in str(e.value)


def test_every_problem_is_reported_at_once():
    with pytest.raises(ConfigError) as e:
        resolve("seed=abc", "optimizer.lr=-1", "runtime.remat=x")
    msg = str(e.value)
    assert all(k in msg for k in ("train.seed", "train.optimizer.lr", "train.runtime.remat")), msg


def test_good_values_pass_and_numbers_are_numbers():
    tc = resolve("optimizer.lr=1e-3", "optimizer.adam_lr=3", "run_name=7", "output_dir=gs://bucket/runs",
                 "peak_tflops=459", "optimizer.freeze=['*/w[123]', 're:^lm_head']")
    # YAML reads 1e-3 (no dot) as a string; the schema makes it the number it means
    assert tc["optimizer"]["lr"] == 1e-3 and isinstance(tc["optimizer"]["lr"], float)
    assert tc["optimizer"]["adam_lr"] == 3.0 and tc["run_name"] == "7" and tc["peak_tflops"] == 459.0
    assert resolve(section={"optimizer": None})["optimizer"] == tconf.DEFAULTS["optimizer"]


def test_the_schema_covers_every_default():
    """A key added to DEFAULTS needs its rule in SCHEMA (one line each)."""
    def walk(defaults, schema, where=""):
        for key, value in defaults.items():
            assert key in schema, f"train.{where}{key} has no rule in train/config.py SCHEMA"
            if isinstance(value, dict):
                assert isinstance(schema[key], dict), f"train.{where}{key}"
                walk(value, schema[key], f"{where}{key}.")
    walk(tconf.DEFAULTS, tconf.SCHEMA)
    assert set(tconf.SCHEMA) == set(tconf.DEFAULTS)
    tconf.resolve({})   # the defaults pass their own rules


def test_schema_enums_are_what_the_code_accepts():
    """Every value an enum allows is one the code runs (so the list an error shows is the
    truth), and distinct values do distinct things where that is cheap to see."""
    import jax.numpy as jnp

    from k3jax.config import RuntimeOptions, load
    from k3jax.tokenizer import tokenizer_for
    from k3jax.train.muon import per_block_muon, schedule
    from k3jax.train.step import balance_method

    S = tconf.SCHEMA
    for key in ("dtype", "param_dtype", "remat", "kda_impl", "moe_dispatch", "expert_format"):
        for v in S["runtime"][key].allowed:
            assert getattr(RuntimeOptions(**{key: v}), key) == v
    cfg = load("toy")
    for kv_b in S["optimizer"]["kv_b_mode"].allowed:
        for scaling in S["optimizer"]["muon_scaling"].allowed:
            per_block_muon(cfg, {}, kv_b_mode=kv_b, scaling=scaling)
    o = tconf.resolve({})["optimizer"]
    lrs = {s: float(schedule({**o, "schedule": s}, 100, 1.0)(jnp.asarray(60))) for s in S["optimizer"]["schedule"].allowed}
    # warmup 10, min_lr_ratio 0.1: step 60 is 50/90 of the way down the cosine
    assert lrs == {"constant": 1.0, "cosine": pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 50 / 90)))}
    for m in S["balance"]["method"].allowed:
        assert balance_method(cfg, tconf.resolve({}, {"balance": {"method": m}})) in ("exact", "hist")
    assert tokenizer_for(cfg, "byte").encode("a") == [cfg.bos_token_id, 97]
    with pytest.raises(ConfigError, match="bpe_file"):     # known, but needs its file
        tokenizer_for(cfg, "tiktoken")


def test_chat_data_is_not_streamed():
    with pytest.raises(ConfigError, match="train.data.loader: 'grain' streams text documents"):
        resolve("data.loader=grain", "data.format=chat")
    assert resolve("data.format=chat", "data.chat.thinking_effort=null")["data"]["chat"]["thinking_effort"] is None


def test_freeze_patterns_must_match_a_param():
    paths = ["embed_tokens/embedding", "layers_0/mlp/up_proj/kernel", "groups/sub_0/block_sparse_moe/w1"]
    tconf.check_freeze(["*/w[123]", "re:^embed"], paths)
    with pytest.raises(ConfigError, match=r"\['\*/w4'\] match no param"):
        tconf.check_freeze(["*/w[123]", "*/w4"], paths)


def test_resume_conflicts_name_the_keys():
    saved = resolve("steps=40", "seed=1")
    assert tconf.resume_conflicts(saved, resolve("steps=40", "seed=1", "optimizer.lr=0.01")) == []
    got = tconf.resume_conflicts(saved, resolve("steps=100", "seed=2", "data.seq_len=64"))
    assert [c.split(":")[0] for c in got] == ["train.data.seq_len", "train.seed", "train.steps"], got
    assert "40 -> 100" in got[-1] and "128 -> 64" in got[0]
    # a constant schedule, before and after, does not depend on steps
    const = resolve("steps=40", "optimizer.schedule=constant")
    assert tconf.resume_conflicts(const, resolve("steps=100", "optimizer.schedule=constant")) == []
    assert tconf.resume_conflicts(saved | {"seed": 0}, resolve("steps=100", "optimizer.schedule=constant"))
    # a run saved before a data key existed had its default
    older = {**saved, "data": {k: v for k, v in saved["data"].items() if k != "shuffle_window"}}
    assert tconf.resume_conflicts(older, resolve("steps=40", "seed=1")) == []
    # 'auto' picks the tokenizer a run saved before it existed named; a text run's chat settings are unused
    assert tconf.resume_conflicts({**saved, "data": {**saved["data"], "tokenizer": "byte"}}, saved) == []
    assert tconf.resume_conflicts(saved, resolve("steps=40", "seed=1", "data.chat.train_on=last")) == []
    chat = resolve("steps=40", "seed=1", "data.format=chat")
    assert [c.split(":")[0] for c in tconf.resume_conflicts(chat, resolve(
        "steps=40", "seed=1", "data.format=chat", "data.chat.train_on=last"))] == ["train.data.chat"]
    # a LoRA run's checkpoints hold its adapters: their shape and their base may not change
    lora = resolve("steps=40", "seed=1", "lora.rank=4", "init_from=base")
    got = tconf.resume_conflicts(lora, resolve("steps=40", "seed=1", "lora.rank=8", "init_from=other"))
    assert [c.split(":")[0] for c in got] == ["train.lora.rank", "train.init_from"], got
    assert tconf.resume_conflicts(saved, resolve("steps=40", "seed=1", "init_from=other")) == []


def test_the_runtime_section_is_runtime_options():
    """`runtime:` is RuntimeOptions itself: every field but `lora` (its own section) and
    `qat` (a top-level key), with RuntimeOptions' defaults, and what it resolves to builds a
    RuntimeOptions."""
    import dataclasses

    from k3jax.config import RuntimeOptions
    fields = {f.name for f in dataclasses.fields(RuntimeOptions)} - {"lora", "qat"}
    rt = resolve()["runtime"]
    assert set(rt) == fields
    assert rt == {k: getattr(RuntimeOptions(), k) for k in fields}
    got = RuntimeOptions(**resolve("runtime.ep_buffer_mib=256", "runtime.kda_chunk_size=32")["runtime"])
    assert (got.ep_buffer_mib, got.kda_chunk_size) == (256.0, 32)


@pytest.mark.parametrize("item,hint", [
    ("optimizer.freeze=*/w1", """quote the glob and give a list: optimizer.freeze='["*/w1"]'"""),
    ("run_name=&x/y", """a text starting with '&' needs quotes: run_name='"&x/y"'"""),
    ("data.path=@file", """a text starting with '@' needs quotes"""),
])
def test_yaml_indicators_in_overrides_say_how_to_quote(item, hint):
    """An override value YAML cannot read is one ConfigError naming the override and, where the
    cause is a leading YAML indicator (a glob's '*'), how to quote it; the quoted form is read."""
    with pytest.raises(ConfigError, match=re.escape(hint)):
        tconf.parse_overrides([item])
    key, raw = item.split("=", 1)
    fixed = f'["{raw}"]' if key.endswith("freeze") else f'"{raw}"'
    node = tconf.parse_overrides([f"{key}={fixed}"])
    for part in key.split("."):
        node = node[part]
    assert node == ([raw] if key.endswith("freeze") else raw)
