"""GRPO (issue 35): group advantages and the clipped, KL-penalised loss in each aggregation
against a NumPy implementation written from the papers (tests/reference.py); the built-in
rewards on hand-made replies, a reward that raises or a module:function that does not load;
prompt files the reader refuses, one line naming file:line; the config keys GRPO adds."""
import json
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from k3jax.chat import parse_reply
from k3jax.config import ConfigError
from k3jax.errors import InputError
from k3jax.train import config as tconf, grpo, rewards

from reference import grpo_advantages_ref, grpo_loss_ref


@pytest.mark.parametrize("scale", [True, False])
def test_group_advantages_match_the_paper(scale):
    rng = np.random.default_rng(int(scale))
    r = rng.integers(0, 3, (6, 8)).astype(np.float64) + rng.normal(0, 0.1, (6, 8))
    r[2] = 1.0                                  # a group whose rewards all agree: no signal
    got = grpo.group_advantages(r, scale)
    want = grpo_advantages_ref(r, scale)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(got[2], 0.0)
    assert np.abs(want).max() > 0.5


def _draw(seed, B=6, T=12):
    rng = np.random.default_rng(seed)
    old = rng.uniform(-4, -0.1, (B, T))
    logp = old + rng.normal(0, 0.3, (B, T))      # ratios on both sides of [0.8, 1.28]
    ref = old + rng.normal(0, 0.5, (B, T))
    mask = np.zeros((B, T))
    for b, n in enumerate(rng.integers(1, T, B)):
        start = rng.integers(0, T - n + 1)
        mask[b, start:start + n] = 1
    mask[3] = 0                                  # a padding row: counts for nothing
    adv = rng.normal(0, 1, B)
    return logp, old, ref, adv, mask


@pytest.mark.parametrize("agg", ["sequence", "token", "constant"])
@pytest.mark.parametrize("beta,use_ref", [(0.0, False), (0.05, True)])
def test_loss_matches_the_papers(agg, beta, use_ref):
    logp, old, ref, adv, mask = _draw(len(agg) + int(use_ref))
    opts = {"clip_eps": 0.2, "clip_eps_high": 0.28, "kl_beta": beta, "loss_agg": agg, "max_tokens": 16}
    with jax.enable_x64(True):
        total, count, sums = grpo.token_terms(opts, *(jnp.asarray(x) for x in (logp, old)),
                                              jnp.asarray(ref) if use_ref else None, jnp.asarray(adv),
                                              jnp.asarray(mask))
        got = float(total) / float(count)
        kl, clip = float(sums["kl"]) / float(count), float(sums["clip_fraction"]) / float(count)
    want, want_kl, want_clip = grpo_loss_ref(logp, old, ref if use_ref else None, adv, mask, 0.2, 0.28, beta,
                                             agg, 16)
    assert abs(got - want) <= 1e-9 * max(1.0, abs(want)), (got, want)
    assert abs(kl - want_kl) <= 1e-9 and abs(clip - want_clip) <= 1e-9
    assert 0.05 < want_clip < 0.95                 # the draws do hit the clip, on both sides
    if use_ref:
        assert want_kl > 1e-3


def test_clipped_tokens_get_no_gradient():
    # ratio 1.5 with a positive advantage is past 1 + ε: the surrogate is flat there
    logp = jnp.log(jnp.array([[1.5, 1.0]]) * 0.2)
    old = jnp.log(jnp.array([[0.2, 0.2]]))
    opts = {"clip_eps": 0.2, "clip_eps_high": None, "kl_beta": 0.0, "loss_agg": "token", "max_tokens": 2}

    def loss(lp):
        return grpo.token_terms(opts, lp, old, None, jnp.array([1.0]), jnp.ones((1, 2)))[0]
    g = jax.grad(loss)(logp)
    assert float(g[0, 0]) == 0.0 and float(g[0, 1]) == pytest.approx(-1.0)


# ---------------------------------------------------------------------------- rewards
TOOLS = [{"type": "function", "function": {"name": "weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"},
                                     "unit": {"type": "string", "enum": ["c", "f"]}},
    "required": ["city"], "additionalProperties": False}}}]


def _call(args: str, name="weather"):
    return (f'<|open|>call tool="{name}"<|sep|><|open|>json<|sep|>{args}<|close|>json<|sep|>'
            f'<|close|>call<|sep|><|end_of_msg|>')


def _reply(text, reason="stop"):
    return {**parse_reply(text, thinking=False), "finish_reason": reason}


def test_exact_match_and_format_on_parsed_replies():
    rec = {"messages": [{"role": "user", "content": "Copy: abc"}], "answer": "abc"}
    good = _reply("abc<|close|>response<|sep|><|close|>message<|sep|><|end_of_msg|>")
    assert good["content"] == "abc"
    assert rewards.exact_match(rec, good) == 1.0 and rewards.format_reward(rec, good) == 1.0
    assert rewards.exact_match(rec, _reply("abd<|end_of_msg|>")) == 0.0
    cut = _reply("abc", reason="length")           # right text, but the turn never ended
    assert rewards.exact_match(rec, cut) == 1.0 and rewards.format_reward(rec, cut) == 0.0
    assert rewards.format_reward(rec, _reply("<|end_of_msg|>")) == 0.0


@pytest.mark.parametrize("args,want", [
    ('{"city": "Oslo", "days": 3}', 1.0),
    ('{"city": "Oslo", "unit": "k"}', 0.0),        # outside the enum
    ('{"days": 3}', 0.0),                          # required key missing
    ('{"city": "Oslo", "days": "3"}', 0.0),        # wrong type
    ('{"city": "Oslo", "wind": 1}', 0.0),          # additionalProperties false
    ('{"city": "Oslo"', 0.0),                      # not JSON
])
def test_tool_call_validates_against_the_schema(args, want):
    rec = {"messages": [{"role": "user", "content": "Weather in Oslo?"}], "tools": TOOLS}
    reply = _reply(_call(args))
    assert len(reply["tool_calls"]) == 1
    assert rewards.tool_call(rec, reply) == want


def test_tool_call_name_and_expected_answer():
    rec = {"messages": [{"role": "user", "content": "x"}], "tools": TOOLS,
           "answer": {"name": "weather", "arguments": {"city": "Oslo"}}}
    assert rewards.tool_call(rec, _reply(_call('{"city": "Oslo"}'))) == 1.0
    assert rewards.tool_call(rec, _reply(_call('{"city": "Rome"}'))) == 0.0
    assert rewards.tool_call(rec, _reply(_call('{"city": "Oslo"}', name="search"))) == 0.0
    assert rewards.tool_call(rec, _reply("Oslo<|end_of_msg|>")) == 0.0


def test_rewards_from_a_module_and_one_that_raises(tmp_path, monkeypatch):
    (tmp_path / "my_rewards.py").write_text(
        "def length(record, reply):\n    return len(reply['content']) / 10\n"
        "def broken(record, reply):\n    return record['missing']\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    r = rewards.Rewards(["exact_match", "my_rewards:length"], [2.0, 1.0])
    rec = {"messages": [], "answer": "abc"}
    total, each = r.score("p.jsonl:4", rec, _reply("abc<|end_of_msg|>"))
    assert each == [1.0, 0.3] and total == pytest.approx(2.3)
    bad = rewards.Rewards(["my_rewards:broken"])
    with pytest.raises(InputError) as e:
        bad.score("data/p.jsonl:7", rec, _reply("abc"))
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith("data/p.jsonl:7: reward my_rewards:broken raised KeyError")
    for name, part in [("no_such_module_x:f", "cannot load"), ("my_rewards:nope", "cannot load"),
                       ("exactmatch", "neither a built-in")]:
        with pytest.raises(ConfigError, match=part):
            rewards.Rewards([name])
    sys.modules.pop("my_rewards", None)


# ---------------------------------------------------------------------------- prompt files
@pytest.mark.parametrize("line,err", [
    ('{"answer": 1}', "missing 'messages'"),
    ('{"messages": []}', "'messages' must be a non-empty list"),
    ('{"messages": ["hi"]}', "messages[0] must be an object with a 'role'"),
    ('{"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]}',
     "messages[1] is an assistant turn"),
    ('{"messages": [{"role": "user", "content": "a"}], "tools": {}}', "'tools' must be a list"),
    ('[1, 2]', "expected an object"),
    ('{"messages": [', "not valid JSON"),
])
def test_bad_prompt_files_name_file_and_line(tmp_path, line, err):
    p = tmp_path / "p.jsonl"
    p.write_text('{"messages": [{"role": "user", "content": "Copy: ab"}], "answer": "ab"}\n\n' + line + "\n")
    with pytest.raises(InputError) as e:
        grpo.read_prompts(str(p))
    msg = str(e.value)
    assert msg.startswith(f"{p}:3: ") and err in msg and "\n" not in msg


def test_a_prompt_too_long_for_the_row_names_its_line(tmp_path):
    from k3jax.tokenizer import ByteTokenizer
    from k3jax.train.rollouts import build_prompts
    p = tmp_path / "p.jsonl"
    p.write_text(json.dumps({"messages": [{"role": "user", "content": "Copy: ab"}], "answer": "ab"}) + "\n"
                 + json.dumps({"messages": [{"role": "user", "content": "x" * 200}], "answer": "x"}) + "\n")
    tc = tconf.resolve({"objective": "grpo", "data": {"format": "chat", "seq_len": 128, "batch_size": 8, "chat": {
        "thinking": False, "thinking_effort": None}}, "grpo": {"max_tokens": 32}})
    with pytest.raises(InputError, match=rf"^{p}:2: the prompt renders to \d+ tokens; .* holds 97"):
        build_prompts(tc, ByteTokenizer(), str(p))


def test_config_keys():
    tc = tconf.resolve({"objective": "grpo", "data": {"format": "chat", "batch_size": 16, "eval_path": "e.jsonl"},
                        "grpo": {"group_size": 4, "loss_agg": "token", "rewards": ["exact_match", "format"]}})
    assert tc["grpo"]["group_size"] == 4 and tc["data"]["eval_path"] == "e.jsonl"
    for over, part in [({"data": {"format": "chat", "batch_size": 6}}, "not a multiple of grpo.group_size 8"),
                       ({"data": {"batch_size": 8}}, "set data.format: chat"),
                       ({"data": {"format": "chat", "batch_size": 8, "seq_len": 32}}, "leaves no room"),
                       ({"data": {"format": "chat", "batch_size": 8}, "grpo": {"loss_agg": "mean"}}, "'mean' is not one of"),
                       ({"data": {"format": "chat", "batch_size": 8}, "grpo": {"rewards": ["a", "b"],
                                                                             "reward_weights": [1]}}, "1 weights for 2")]:
        with pytest.raises(ConfigError, match=part):
            tconf.resolve({"objective": "grpo", **over})
    saved = tconf.resolve({"objective": "grpo", "data": {"format": "chat"}})
    new = tconf.resolve({"objective": "grpo", "data": {"format": "chat"}, "grpo": {"kl_beta": 0.1}})
    assert tconf.resume_conflicts(saved, new) == ["train.grpo.kl_beta: 0.0 -> 0.1"]
