"""DPO (issue 35): each loss variant against a NumPy implementation written from the papers
(tests/reference.py); the train step's per-sequence completion log-probs, reference sums and
loss against plain forwards of each conversation alone; preference files that the reader
refuses, one line naming file:line and the field; the config keys DPO adds."""
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from k3jax.chat import render, tokenize
from k3jax.config import ConfigError
from k3jax.errors import InputError
from k3jax.tokenizer import ByteTokenizer
from k3jax.train import config as tconf, dpo
from k3jax.train.preference import PreferenceDataset, read_pairs

from reference import preference_loss_ref

TOK = ByteTokenizer()
OPTS = {"thinking": False, "thinking_effort": None}

VARIANTS = [("sigmoid", {}), ("sigmoid", {"label_smoothing": 0.2}), ("ipo", {}),
            ("simpo", {"gamma": 0.7}), ("simpo", {"gamma": 0.3, "label_smoothing": 0.1})]


@pytest.mark.parametrize("loss,extra", VARIANTS)
def test_pair_losses_match_the_papers(loss, extra):
    rng = np.random.default_rng(len(loss) + len(extra))
    n = 64
    pc, pr = rng.uniform(-80, -5, n), rng.uniform(-80, -5, n)
    rc, rr = pc + rng.normal(0, 3, n), pr + rng.normal(0, 3, n)
    nc, nr = rng.integers(1, 40, n).astype(np.float64), rng.integers(1, 40, n).astype(np.float64)
    beta = 0.3
    want = preference_loss_ref(pc, pr, rc, rr, nc, nr, loss, beta, **extra)
    opts = {"loss": loss, "beta": beta, "label_smoothing": 0.0, "gamma": 0.0, **extra}
    with jax.enable_x64(True):
        got, wc, wr = dpo.pair_losses(*(jnp.asarray(x) for x in (pc, pr, rc, rr, nc, nr)), **{
            k: v for k, v in opts.items()})
        got = np.asarray(got)
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=0)
    assert np.ptp(want) > 0.1                              # the draws exercise the loss, not one value
    reward = (lambda p, r, m: beta * p / m) if loss == "simpo" else (lambda p, r, m: beta * (p - r))
    np.testing.assert_allclose(np.asarray(wc), reward(pc, rc, nc), rtol=1e-12)
    np.testing.assert_allclose(np.asarray(wr), reward(pr, rr, nr), rtol=1e-12)


def _records():
    tools = [{"type": "function", "function": {"name": "f"}}]
    return [
        {"prompt": [{"role": "user", "content": "Upper: river"}],
         "chosen": [{"role": "assistant", "content": "RIVER"}], "rejected": [{"role": "assistant", "content": "river"}]},
        {"prompt": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Yo."},
                    {"role": "user", "content": "Lower: STONE"}],
         "chosen": [{"role": "assistant", "content": "stone"}],
         "rejected": [{"role": "assistant", "content": "no, STONE!"}]},
        {"tools": tools, "prompt": [{"role": "user", "content": "Find x"}],
         "chosen": [{"role": "assistant", "content": "",
                     "tool_calls": [{"type": "function", "function": {"name": "f", "arguments": {"q": "x"}}}]}],
         "rejected": [{"role": "assistant", "content": "x?"}]},
        {"prompt": [{"role": "user", "content": "Count"}],
         "chosen": [{"role": "assistant", "content": "1 2 3"}], "rejected": [{"role": "assistant", "content": "3"}]},
    ]


def _write(path, rows):
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return str(path)


def _conversation(rec, key):
    """(ids of prompt + rec[key], where its completion starts): the completion is what
    follows the rendered prompt's generation prompt (CHAT_FORMAT.md §4's prefix property)."""
    head = tokenize(render(rec["prompt"], rec.get("tools"), add_generation_prompt=True, **OPTS), TOK)
    ids = tokenize(render(rec["prompt"] + rec[key], rec.get("tools"), add_generation_prompt=False, **OPTS), TOK)
    assert ids[:len(head)] == head
    return ids, len(head)


def _plain_completion_logps(cfg, params, convs, width):
    """Σ log p over each conversation's completion, from a forward of that conversation
    alone (each in its own batch row, padded after its end: causal, so the padding changes
    no logit read), log-softmax in float64."""
    from k3jax.model import forward
    rows = np.full((len(convs), width), 511, np.int32)
    for i, (ids, _) in enumerate(convs):
        rows[i, :len(ids)] = ids
    logits = np.asarray(forward(cfg, params, rows), np.float64)
    top = logits.max(-1, keepdims=True)
    logp = logits - top - np.log(np.exp(logits - top).sum(-1, keepdims=True))
    return np.asarray([sum(logp[i, j - 1, ids[j]] for j in range(start, len(ids)))
                       for i, (ids, start) in enumerate(convs)])


@pytest.mark.slow
def test_step_scores_completions_as_plain_forwards_do(tmp_path):
    """A DPO step (2 microbatches of 2 pairs, learning rates 0) reports each completion's
    log-prob sum, the reference sums of its batch's ref_logp and the loss exactly as plain
    forwards of each conversation alone give them; so does evaluation (dpo.Evaluator)."""
    from flax import linen as nn

    from k3jax.config import K3Config
    from k3jax.model import init_params
    from k3jax.train import muon, step as tstep
    from k3jax.testing.variants import variant_dict

    d = variant_dict(layers=("kda", "mla"))
    d.pop("train", None)
    cfg = K3Config.from_hf(d).text.with_runtime(moe_dispatch="dense", kda_impl="recurrent")
    recs = _records()
    ds = PreferenceDataset(read_pairs(_write(tmp_path / "p.jsonl", recs)), TOK, 640, 511, options=OPTS)
    assert ds.n_rows == 4 and ds.too_long == 0
    A, B = 2, 2
    tc = tconf.resolve({}, {"objective": "dpo", "dpo": {"beta": 0.5, "label_smoothing": 0.1},
                            "data": {"format": "chat", "seq_len": 640, "batch_size": B, "grad_accum": A},
                            "optimizer": {"lr": 0.0, "adam_lr": 0.0}, "balance": {"enabled": False}})
    params = nn.unbox(init_params(cfg, jax.random.PRNGKey(0)))
    ref = np.random.default_rng(0).normal(-3.0, 1.0, (4, 640)).astype(np.float32)
    ds.ref = ref
    batch = {k: v.reshape(A, B, -1) for k, v in ds.rows(np.arange(4)).items()}

    chosen = [_conversation(rec, "chosen") for rec in recs]
    rejected = [_conversation(rec, "rejected") for rec in recs]
    pc, pr = np.split(_plain_completion_logps(cfg, params, chosen + rejected, 640), 2)
    # the row: the chosen conversation at 0, the rejected right after it; the target at
    # position t is token t + 1
    rc = np.asarray([ref[i, hc - 1:len(c) - 1].astype(np.float64).sum() for i, (c, hc) in enumerate(chosen)])
    rr = np.asarray([ref[i, len(c) + hr - 1:len(c) + len(r) - 1].astype(np.float64).sum()
                     for i, ((c, _), (r, hr)) in enumerate(zip(chosen, rejected))])
    ev = dpo.Evaluator(cfg, tc, ds, 3)(params)          # before the step, which donates the params
    tx, groups = muon.build_optimizer(cfg, params, tc["optimizer"], 10)
    _, m = tstep.make_train_step(cfg, tc, tx, groups)(tstep.init_state(params, tx, groups), batch)

    assert float(m["chosen_logp"]) == pytest.approx(pc.mean(), rel=1e-5)
    assert float(m["rejected_logp"]) == pytest.approx(pr.mean(), rel=1e-5)
    assert float(m["tokens"]) == 4                                       # pairs: the loss's denominator
    losses = preference_loss_ref(pc, pr, rc, rr, 1, 1, "sigmoid", 0.5, label_smoothing=0.1)
    assert float(m["loss"]) == pytest.approx(losses.mean(), rel=1e-5)
    margin = 0.5 * ((pc - rc) - (pr - rr))
    assert float(m["reward_margin"]) == pytest.approx(margin.mean(), rel=1e-4, abs=1e-5)
    assert float(m["reward_accuracy"]) == np.mean(margin > 0)
    assert float(m["logp_accuracy"]) == np.mean(pc > pr)
    # evaluation over the same pairs, 3 a forward (the last batch padded): the same numbers
    assert ev["eval_pairs"] == 4 and ev["eval_accuracy"] == np.mean(pc > pr)
    assert ev["eval_chosen_logp"] == pytest.approx(pc.mean(), rel=1e-5)
    assert ev["eval_rejected_logp"] == pytest.approx(pr.mean(), rel=1e-5)
    assert ev["eval_loss"] == pytest.approx(losses.mean(), rel=1e-5)
    assert ev["eval_reward_margin"] == pytest.approx(margin.mean(), rel=1e-4, abs=1e-5)


BAD = [
    ('{"prompt": [], "chosen": [{"role": "assistant", "content": "a"}]}', "missing 'rejected'"),
    ('{"prompt": [], "chosen": [], "rejected": [{"role": "assistant", "content": "a"}]}', "'chosen' is empty"),
    ('{"prompt": "hi", "chosen": [{"role": "assistant", "content": "a"}], "rejected": []}', "'prompt' must be a list"),
    ('{"prompt": [], "chosen": [{"role": "assistant", "content": "a"}], "rejected": [{"role": "assistant", ', "not valid JSON"),
    ('{"prompt": [{"role": "user", "content": "q"}], "chosen": [{"role": "assistant", "content": "a"}], '
     '"rejected": [{"role": "robot", "content": "b"}]}', "rejected[0]: role 'robot'"),
    ('{"prompt": [{"role": "user", "content": "q"}], "chosen": [{"role": "user", "content": "a"}], '
     '"rejected": [{"role": "assistant", "content": "b"}]}', "'chosen' has no assistant turn"),
]


@pytest.mark.parametrize("line,why", BAD)
def test_bad_preference_records_name_file_line_and_field(tmp_path, line, why):
    good = json.dumps(_records()[0])
    path = _write(tmp_path / "bad.jsonl", [good, "", line])      # the blank line still counts
    with pytest.raises(InputError) as e:
        PreferenceDataset(read_pairs(path), TOK, 256, 511, options=OPTS)
    msg = str(e.value)
    assert msg.startswith(f"{path}:3: ") and why in msg and "\n" not in msg, msg


def test_bad_records_can_be_skipped_and_counted(tmp_path):
    good = json.dumps(_records()[0])
    bad = BAD[4][0]
    path = _write(tmp_path / "p.jsonl", [good, bad, good])
    ds = PreferenceDataset(read_pairs(path), TOK, 256, 511, options=OPTS, on_bad_record="skip")
    assert ds.n_rows == 2 and len(ds.skipped) == 1 and f"{path}:2:" in ds.summary()
    with pytest.raises(InputError, match="2 longer than a row"):
        PreferenceDataset(read_pairs(_write(tmp_path / "q.jsonl", [good, good])), TOK, 100, 511, options=OPTS)


def test_train_command_reports_a_bad_preference_file_in_one_line(tmp_path, capsys):
    from k3jax import cli
    path = _write(tmp_path / "bad.jsonl", [json.dumps(_records()[0]), BAD[1][0]])
    rc = cli.main(["train", "toy", "objective=dpo", "data.format=chat", f"data.path={path}",
                   f"output_dir={tmp_path}", "run_name=r"])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and err.count("\n") == 0 and f"{path}:2: 'chosen' is empty" in err, err


def test_config_keys_of_the_objectives():
    tc = tconf.resolve({}, {"objective": "dpo", "data": {"format": "chat", "eval_path": "e.jsonl"},
                            "dpo": {"loss": "simpo", "beta": 2, "gamma": 1}})
    assert tc["dpo"] == {"beta": 2.0, "loss": "simpo", "label_smoothing": 0.0, "gamma": 1.0}
    assert tconf.resolve({})["objective"] == "sft"
    for over, why in [({"objective": "ppo"}, "train.objective: 'ppo' is not one of 'sft', 'dpo', 'grpo'"),
                          ({"objective": "grpo"}, "objective 'grpo' renders its prompts in the chat format"),
                      ({"objective": "dpo"}, "train.data.format: 'text'"),
                      ({"objective": "dpo", "data": {"format": "chat"}, "dpo": {"loss": "ipo", "label_smoothing": 0.1}},
                       "train.dpo.label_smoothing: IPO"),
                      ({"data": {"eval_path": "e.jsonl"}}, "train.data.eval_path"),
                      ({"objective": "dpo", "data": {"format": "chat"}, "dpo": {"beta": 0}}, "train.dpo.beta"),
                      ({"objective": "dpo", "data": {"format": "chat"}, "dpo": {"label_smoothing": 0.5}},
                       "train.dpo.label_smoothing")]:
        with pytest.raises(ConfigError, match="^config ") as e:
            tconf.resolve({}, over)
        assert why in str(e.value) and "\n" not in str(e.value), (over, str(e.value))
    # a resumed run keeps its objective and its DPO options; another eval set is allowed
    saved = tconf.resolve({}, {"objective": "dpo", "data": {"format": "chat"}})
    new = tconf.resolve({}, {"objective": "dpo", "data": {"format": "chat", "eval_path": "x.jsonl"},
                             "dpo": {"beta": 0.2}})
    assert tconf.resume_conflicts(saved, new) == ["train.dpo.beta: 0.1 -> 0.2"]
    sft = tconf.resolve({}, {"data": {"format": "chat"}})
    assert "train.objective: 'sft' -> 'dpo'" in tconf.resume_conflicts(sft, saved)
