"""Chat fine-tuning data and commands: packing keeps conversations whole, batches train exactly
`sft_example`'s tokens, images expand to their feature rows with their pixels attached, the toy
chat run (images through the vision tower) lowers its loss, `render-chat` shows what trains and
`generate --messages` decodes the rendered prompt until `<|end_of_msg|>`."""
import base64
import gc
import io
import json
import os

import numpy as np
import pytest

from helpers import ROOT
from k3jax import cli
from k3jax import config as C
from k3jax.chat import parse_reply, render, sft_example, tokenize
from k3jax.chat.packing import Example, pack_examples, read_conversations
from k3jax.tokenizer import ByteTokenizer
from k3jax.train import config as tconf
from k3jax.train.data import ChatDataset, build_dataset
from k3jax.vision.preprocess import preprocess_images, resize_plan

TOK = ByteTokenizer()


def png_url(w, h, colour):
    from PIL import Image
    buf = io.BytesIO()
    Image.new("RGB", (w, h), colour).save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def convo(question, reasoning, answer, image=None):
    content = question if image is None else [{"type": "text", "text": question},
                                              {"type": "image_url", "image_url": {"url": image}}]
    return {"messages": [{"role": "user", "content": content},
                         {"role": "assistant", "reasoning_content": reasoning, "content": answer}]}


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def test_packing_keeps_conversations_whole_and_counts_cuts():
    made = []

    def ex(n, trained=True, images=()):
        train = np.zeros(n, bool)
        train[1:3] = trained
        made.append(Example(f"c{len(made)}", np.arange(n, dtype=np.int32) + 100 * len(made), train, list(images)))
        return made[-1]
    exs = [ex(6), ex(5), ex(4), ex(3), ex(2), ex(2), ex(4, trained=False), ex(12), ex(3)]
    p = pack_examples(exs, seq_len=6, pad_id=-1)      # rows of 7
    assert p.stats == {"conversations": 9, "whole": 7, "cut": 1, "dropped_long": 0, "dropped_untrained": 1,
                       "rows": 5, "tokens": 32, "trained_tokens": 14}
    # best fit, longest first: 7 | 6 | 5+2 | 4+3 | 3+2, the fewest rows of 7 that hold 32 tokens
    assert p.tokens.shape == (5, 7)
    for e in exs[:6] + exs[8:]:      # each kept conversation sits whole, contiguous, in one row
        hits = np.argwhere(p.tokens == e.ids[0])
        assert len(hits) == 1
        r, c = hits[0]
        np.testing.assert_array_equal(p.tokens[r, c:c + len(e.ids)], e.ids)
        assert len(set(p.segs[r, c:c + len(e.ids)])) == 1 and p.segs[r, c] > 0
        np.testing.assert_array_equal(p.train[r, c:c + len(e.ids)], e.train)
    np.testing.assert_array_equal(p.tokens[p.segs == 0], -1)
    # a cut never splits an image's pads: it stops before the image
    long = Example("img", np.arange(20, dtype=np.int32), np.ones(20, bool), [("src", (1, 2, 2), 4, 9)])
    p = pack_examples([long], seq_len=6, pad_id=-1)
    assert p.stats["cut"] == 1 and p.images == [[]] and (p.segs[0] > 0).sum() == 4
    with pytest.raises(ValueError, match="no conversation left"):
        pack_examples([long], seq_len=6, pad_id=-1, truncate=False)


def test_batches_train_exactly_the_sft_tokens(tmp_path):
    rows = [convo("What is 2+2?", "Add.", "4"), convo("Capital of Peru?", "Lima.", "Lima"),
            {"tools": [{"type": "function", "function": {"name": "f"}}], "thinking": False,
             "messages": [{"role": "user", "content": "call f"},
                          {"role": "assistant", "content": "", "tool_calls": [
                              {"id": "1", "type": "function", "function": {"name": "f", "arguments": {"x": 1}}}]},
                          {"role": "tool", "tool_call_id": "1", "content": "ok"},
                          {"role": "assistant", "content": "done"}]}]
    path = write_jsonl(tmp_path / "c.jsonl", rows)
    opts = {"train_on": "all", "thinking": True, "thinking_effort": "low"}
    ds = ChatDataset(read_conversations(path), TOK, 800, 511, options=opts)
    assert ds.stats["whole"] == 3 and not ds.has_images
    want = {}
    for r in rows:
        o = {**opts, **{k: r[k] for k in ("thinking",) if k in r}}
        ex = sft_example(r["messages"], TOK, r.get("tools"), **o)
        want[tuple(ex["ids"])] = ex
    seen = 0
    for step in range(3):
        b = ds.batch(seed=1, step=step, batch_size=1)
        tokens, mask, seg, tgt = (b[k][0, 0] for k in ("tokens", "loss_mask", "segment_ids", "targets"))
        for s in set(seg.tolist()) - {0}:
            at = np.flatnonzero(seg == s)
            # the last token of a row is only a target; a whole conversation is one segment
            ex = next(e for k, e in want.items() if list(k[:len(at)]) == tokens[at].tolist())
            n = len(ex["ids"])
            assert tokens[at[0]:at[0] + n].tolist() == ex["ids"][:len(tokens) - at[0]]
            # position t predicts token t+1: trained exactly where sft_example's mask is 1
            np.testing.assert_array_equal(mask[at[0]:at[0] + n - 1], ex["loss_mask"][1:])
            np.testing.assert_array_equal(tgt[at[0]:at[0] + n - 1], ex["ids"][1:])
            assert at[0] + n - 1 >= len(mask) or mask[at[0] + n - 1] == 0     # never into the next one
            seen += 1
    assert seen >= 3


def test_images_expand_to_their_feature_rows(tmp_path):
    from PIL import Image
    k3 = C.load_k3("toy")
    Image.new("RGB", (84, 56), (0, 200, 0)).save(tmp_path / "green.png")
    rows = [{"messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "green.png"}}, {"type": "text", "text": "and"},
        {"type": "image_url", "image_url": {"url": png_url(30, 100, (9, 9, 9))}}]},
        {"role": "assistant", "content": "two images"}]}]
    path = write_jsonl(tmp_path / "i.jsonl", rows)
    data = tconf.resolve({"data": {"format": "chat", "seq_len": 256, "chat": {"thinking_effort": None}}})["data"]
    ds = build_dataset(data, TOK, k3, path)
    assert ds.has_images
    pad = TOK.token_id("<|media_pad|>")
    ex = sft_example(rows[0]["messages"], TOK, thinking_effort=None, image_sizes=[(84, 56), (30, 100)])
    # rows per image from the processor's plan: (grid_h / 2) * (grid_w / 2)
    plans = [resize_plan(84, 56, ds.media), resize_plan(30, 100, ds.media)]
    n_rows = [(p["grid_h"] // 2) * (p["grid_w"] // 2) for p in plans]
    b = ds.batch(0, 0, 1)
    tokens = b["tokens"][0, 0]
    pads = np.flatnonzero(tokens == pad)
    assert len(pads) == sum(n_rows) and ex["ids"].count(pad) == 2
    first = np.flatnonzero(np.asarray(ex["ids"]) == pad)
    assert pads[0] == first[0] and pads[n_rows[0]] == first[1] + n_rows[0] - 1    # contiguous, in order
    assert b["loss_mask"][0, 0][pads].sum() == 0 and b["loss_mask"][0, 0][pads - 1].sum() == 0
    pixels, grids = preprocess_images([str(tmp_path / "green.png"),
                                       base64.b64decode(rows[0]["messages"][0]["content"][2]["image_url"]["url"]
                                                        .split(",")[1])])
    np.testing.assert_array_equal(b["images"]["pixels"][0], pixels)
    np.testing.assert_array_equal(b["images"]["grid_thws"], grids)
    assert [tuple(g) for g in grids] == [(1, p["grid_h"], p["grid_w"]) for p in plans]
    # a model without a vision tower refuses image data
    with pytest.raises(ValueError, match="vision"):
        build_dataset(data, TOK, C.K3Config(k3.text, None, {}), path)
    # images outside user messages are refused
    bad = [{"messages": [{"role": "assistant", "content": [{"type": "image_url", "image_url": {"url": "green.png"}}]}]}]
    with pytest.raises(ValueError, match="user messages only"):
        build_dataset(data, TOK, k3, write_jsonl(tmp_path / "b.jsonl", bad))


@pytest.mark.slow
def test_toy_chat_run_with_images_lowers_the_loss(tmp_path):
    """A one-layer toy trained on chat rows that each hold an image: every step carries two
    images of one grid (one compile), the vision tower trains along, the loss falls."""
    from k3jax.train import loop
    from k3jax.testing.variants import write_variant
    colours = [(200, 0, 0), (0, 0, 200), (0, 160, 0)]
    rows = [convo(f"What colour is this? ({i})", f"It looks {n}.", n.capitalize() + ".", png_url(56, 56, c))
            for i, (n, c) in enumerate(zip(["red", "blue", "green"], colours))]
    data = write_jsonl(tmp_path / "chat.jsonl", rows)
    train = {"steps": 8, "log_every": 1, "ckpt_every": 8, "keep": 1, "sample_tokens": 0, "peak_tflops": 1.0,
             "output_dir": str(tmp_path), "run_name": "chat", "async_checkpoint": False,
             "data": {"path": data, "format": "chat", "seq_len": 200, "batch_size": 2,
                      "chat": {"thinking_effort": None}},
             "optimizer": {"warmup_steps": 2}, "runtime": {"kda_impl": "recurrent", "moe_dispatch": "dense"}}
    cfg = write_variant(str(tmp_path / "tiny.yaml"), layers=("kda",), train=train)
    logs = []
    assert loop.run(cfg, log=logs.append) == 0
    text = "\n".join(logs)
    assert "chat: 3 conversations -> 3 whole, 0 cut" in text
    with open(tmp_path / "chat" / "metrics.jsonl") as f:
        losses = [json.loads(line)["loss"] for line in f]
    assert len(losses) == 8 and losses[-1] < 0.7 * losses[0], losses
    gc.collect()     # the run's compiled objects go now, not during the xdist worker's shutdown


def test_render_chat_command(tmp_path, capsys):
    rows = [convo("Hi?", "Greet.", "Hello"), convo("Bye?", "", "Bye")]
    path = write_jsonl(tmp_path / "r.jsonl", rows)
    assert cli.main(["render-chat", path, "--json", "--thinking-effort", "high"]) == 0
    out = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    for got, r in zip(out, rows):
        ex = sft_example(r["messages"], TOK, thinking_effort="high")
        assert got["ids"] == ex["ids"] and got["loss_mask"] == ex["loss_mask"]
        assert [tuple(s) for s in got["segments"]] == [tuple(s) for s in render(
            r["messages"], thinking_effort="high", add_generation_prompt=False)]
    assert cli.main(["render-chat", path, "--no-thinking", "--thinking-effort", "none"]) == 0
    shown = capsys.readouterr().out
    assert "⟦Hello<|close|>response<|sep|><|close|>message<|sep|><|end_of_msg|>⟧" in shown
    n = len(sft_example(rows[0]["messages"], TOK, thinking=False, thinking_effort=None)["ids"])
    assert f"r.jsonl:1: {n} tokens" in shown and "2 conversations" in shown
    # the shipped sample renders with the toy chat config
    assert cli.main(["render-chat", os.path.join(ROOT, "data", "chat_sample.jsonl"), "--config",
                     os.path.join(ROOT, "configs", "toy_chat.yaml")]) == 0
    assert "1 image(s)" in capsys.readouterr().out


def test_shipped_toy_chat_config_is_the_toy_model():
    a, b = C.load_k3("toy"), C.load_k3("toy_chat")
    assert a.to_hf() == b.to_hf()
    tc = tconf.resolve(b.train)
    assert tc["data"]["format"] == "chat"
    rows = read_conversations(os.path.join(ROOT, tc["data"]["path"]))
    assert any(m["role"] == "tool" for _, _, r in rows for m in r["messages"])
    assert any(isinstance(m["content"], list) for _, _, r in rows for m in r["messages"] if m["role"] == "user")


@pytest.fixture(scope="module")
def tiny_checkpoint(tmp_path_factory):
    """A one-layer toy K3 with random weights, written as an HF safetensors directory."""
    import jax

    from k3jax import model as M
    from k3jax.checkpoint.hf_params import from_tree_layout
    from k3jax.checkpoint.names import stored_shape, tensor_map
    from k3jax.checkpoint.safetensors_io import write_safetensors
    from k3jax.testing.variants import variant_dict
    d = tmp_path_factory.mktemp("tiny_ckpt")
    hf = variant_dict(layers=("kda",))
    hf.pop("train")
    cfg = C.K3Config.from_hf(hf).text
    rng = np.random.default_rng(3)     # numpy weights: nothing to compile
    params = jax.tree_util.tree_map_with_path(
        lambda p, s: np.ones(s.shape, np.float32) if p[-1].key in ("weight", "norm") else
        (0.05 * rng.normal(size=s.shape)).astype(np.float32), M.param_shapes(cfg))
    out = {}
    for e in tensor_map(cfg, "k3", "mlp"):
        leaf = params
        for k in e.path:
            leaf = leaf[k]
        slot = np.asarray(leaf, np.float32)[e.index]
        if e.is_expert:
            out[f"{e.hf}.weight"] = np.ascontiguousarray(slot.T)
        else:
            out[e.hf] = from_tree_layout(e, slot, stored_shape(e, slot.shape, cfg, "k3"))
    write_safetensors(d / "model.safetensors", out)
    (d / "config.json").write_text(json.dumps(hf))
    return d


def test_generate_messages_decodes_the_rendered_prompt(tiny_checkpoint, tmp_path, capsys):
    from k3jax.checkpoint.load import load_model_dir
    from k3jax.infer import generate as G
    from k3jax.infer.sampling import SamplingParams
    d = tiny_checkpoint
    conv = tmp_path / "conv.json"
    msgs = [{"role": "user", "content": "Hi"}]
    conv.write_text(json.dumps({"messages": msgs}))
    out = tmp_path / "out.json"
    assert cli.main(["generate", str(d), "--messages", str(conv), "--thinking-effort", "none", "--max-new-tokens", "6",
                     "--json", "--out", str(out)]) == 0
    reply = json.loads(capsys.readouterr().out)
    got = json.loads(out.read_text())
    k3, params = load_model_dir(d)
    tok = ByteTokenizer.for_config(k3)
    prompt = tokenize(render(msgs, thinking_effort=None), tok)
    want = G.generate(k3.text, params, [prompt], 6, SamplingParams(), eos_id=tok.token_id("<|end_of_msg|>"))[0]
    assert got["generated_ids"] == want
    assert reply == got["reply"] == parse_reply(want, tokenizer=tok)
    # streamed: reasoning under its own label (the reply starts inside the pre-opened think)
    assert cli.main(["generate", str(d), "--messages", str(conv), "--thinking-effort", "none",
                     "--max-new-tokens", "6"]) == 0
    shown = capsys.readouterr().out
    assert not reply["reasoning_content"] or shown.startswith("[reasoning]\n" + reply["reasoning_content"])
    with pytest.raises(SystemExit):
        cli.main(["generate", str(d), "--messages", str(conv), "--prompt", "x"])
    conv.write_text("[]")
    assert cli.main(["generate", str(d), "--messages", str(conv)]) == 2
