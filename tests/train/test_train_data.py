"""Data: packing, loss masks, (seed, step) order, JSONL, the tiktoken tokenizer, and
packed-row loss == per-document loss through the real model."""
import base64
import re
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from k3jax.config import K3Config
from k3jax.model import K3Model, init_params
from k3jax.tokenizer import ByteTokenizer, TiktokenTokenizer
from k3jax.train.data import PackedDataset, pack, read_documents, rows_to_batch
from k3jax.train.step import cross_entropy
from k3jax.testing.variants import variant_dict


def test_pack_segments_and_mask():
    docs = [[256, 1, 2, 3, 257], [256, 4, 5, 257], [256, 6, 7, 8, 9, 10, 257]]
    tokens, segs = pack(docs, seq_len=7, pad_id=511)
    assert tokens.shape == (2, 8)
    np.testing.assert_array_equal(segs[0], [1, 1, 1, 1, 1, 2, 2, 2])
    np.testing.assert_array_equal(segs[1], [1, 2, 2, 2, 2, 2, 2, 2])
    b = rows_to_batch(tokens, segs)
    # no target crosses a document boundary
    assert b["loss_mask"][0, 4] == 0 and b["loss_mask"][1, 0] == 0
    assert b["loss_mask"].sum() == 14 - 2      # 14 inputs, 2 of them end a document piece


def test_batches_depend_only_on_seed_and_step():
    docs = [f"document number {i} " * (1 + i % 4) for i in range(50)]
    tok = ByteTokenizer()
    a, b = PackedDataset(docs, tok, 32, 511), PackedDataset(docs, tok, 32, 511)
    for step in (0, 3, 17):
        x, y = a.batch(0, step, 4, 2), b.batch(0, step, 4, 2)
        for key in x:
            np.testing.assert_array_equal(x[key], y[key])
        assert x["tokens"].shape == (2, 4, 32)
    assert not np.array_equal(a.batch(0, 1, 4)["tokens"], a.batch(1, 1, 4)["tokens"])


def test_jsonl_and_text_files(tmp_path):
    p = tmp_path / "d.jsonl"
    p.write_text(json.dumps({"text": "a b"}) + "\n\n" + json.dumps({"text": "c"}) + "\n")
    assert read_documents(str(p)) == ["a b", "c"]
    (tmp_path / "bad.jsonl").write_text('{"txt": 1}\n')
    with pytest.raises(ValueError, match="bad.jsonl:1"):
        read_documents(str(tmp_path / "bad.jsonl"))
    assert len(read_documents("data/corpus.txt")) > 20
    assert len(read_documents("data/sample.jsonl")) == 4


def test_tiktoken_tokenizer_roundtrip(tmp_path):
    pytest.importorskip("tiktoken")
    ranks = [bytes([i]) for i in range(256)] + [b"th", b"the", b" the"]
    bpe = tmp_path / "tiktoken.model"
    bpe.write_text("".join(f"{base64.b64encode(t).decode()} {i}\n" for i, t in enumerate(ranks)))
    tok = TiktokenTokenizer(str(bpe), vocab_size=300, bos_id=290, eos_id=291, pad_id=299)
    ids = tok.encode("the theme of the day", bos=True, eos=True)
    assert ids[0] == 290 and ids[-1] == 291 and 258 in ids      # merges are used
    assert tok.decode(ids) == "the theme of the day"
    assert all(i < 259 for i in tok.encode("<|reserved_token_291|>", bos=False))   # no injected specials


@pytest.mark.slow
def test_packed_row_loss_equals_per_document_loss():
    d = variant_dict(layers=("kda", "mla"))
    d.pop("train", None)
    cfg = K3Config.from_hf(d).text.with_runtime(moe_dispatch="dense", kda_impl="recurrent")
    params = init_params(cfg, jax.random.PRNGKey(0))
    tok = ByteTokenizer.for_config(cfg)
    docs = [tok.encode(t, bos=True, eos=True) for t in ("The cat sat.", "A dog ran far away!", "Hi")]
    tokens, segs = pack(docs, seq_len=sum(map(len, docs)) - 1, pad_id=cfg.pad_token_id)
    b = rows_to_batch(tokens, segs)
    model = K3Model(cfg)
    # One jitted apply for every call (same shapes): the reference runs each document alone
    # at the start of a row of the same length, as ONE segment; the tail after it is causally
    # invisible to the document's positions.
    apply = jax.jit(lambda t, s: model.apply({"params": params}, t, s))
    T = b["tokens"].shape[-1]
    logits = apply(jnp.asarray(b["tokens"]), jnp.asarray(b["segment_ids"]))
    packed, count = cross_entropy(logits, b["targets"], b["loss_mask"])
    separate, n = 0.0, 0
    for doc in docs:
        x = np.full((1, T), cfg.pad_token_id, np.int32)
        y = np.zeros((1, T), np.int32)
        mask = np.zeros((1, T), np.float32)
        x[0, :len(doc) - 1], y[0, :len(doc) - 1], mask[0, :len(doc) - 1] = doc[:-1], doc[1:], 1.0
        lg = apply(jnp.asarray(x), jnp.ones((1, T), jnp.int32))
        l, c = cross_entropy(lg, jnp.asarray(y), jnp.asarray(mask))
        separate, n = separate + float(l), n + int(c)
    assert int(count) == n
    np.testing.assert_allclose(float(packed), separate, rtol=1e-5)


def test_undecodable_bytes_name_the_file_line_and_byte(tmp_path, capsys):
    """Every reader of the user's text data (documents .txt/.jsonl, chat .jsonl, the streamed
    loader's records, render-chat) refuses bytes that are not UTF-8 in one line naming the
    file, the line where it knows it, and the byte offset (a traceback before)."""
    from k3jax.chat.packing import read_conversations
    from k3jax.cli import main
    from k3jax.errors import InputError
    from k3jax.train import stream

    good = '{"text": "fine"}\n'.encode()
    bad = good + b'{"text": "caf\xe9"}\n'          # Latin-1 é at byte len(good) + 13
    offset = len(good) + 13
    cases = {"docs.jsonl": (bad, lambda p: read_documents(p)),
             "docs.txt": (b"one\n\ntwo \xff\xfe three\n", lambda p: read_documents(p)),
             "chat.jsonl": (b'{"messages": [{"role": "user", "content": "hi"}]}\n' + b'\x80\n',
                            lambda p: read_conversations(p))}
    for name, (data, read) in cases.items():
        path = tmp_path / name
        path.write_bytes(data)
        byte = data.index(next(b for b in (b"\xe9", b"\xff", b"\x80") if b in data))
        line = data.count(b"\n", 0, byte) + 1
        with pytest.raises(InputError, match=rf"{path}:{line}: not UTF-8 text \(byte {byte} "):
            read(str(path))
    with pytest.raises(InputError, match=rf"x.jsonl: not UTF-8 text \(byte {offset} "):
        stream.parse(bad[len(good):], "jsonl", "text", "x.jsonl", len(good))
    chat = tmp_path / "chat.jsonl"
    assert main(["render-chat", str(chat)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and f"{chat}:2: not UTF-8 text (byte" in err, err


BAD_CHATS = [   # (messages, what the error names)
    ([{"role": "user", "content": "hi"}, {"role": "assistant", "content": "",
      "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{oops"}}]}],
     "messages[1].tool_calls[0].function.arguments: not JSON"),
    ([{"role": "user", "content": "hi"}, {"role": "assistant", "tool_calls": [
        {"id": "c1", "function": {"name": "f", "arguments": "[1, 2]"}}]}],
     "messages[1].tool_calls[0].function.arguments: must be a JSON object, got list"),
    ([{"role": "user", "content": "hi"}, {"role": "assistant", "content": "  "}],
     "messages[1]: an assistant turn needs 'content' or 'tool_calls'"),
    ([{"role": "user", "content": "hi"}, {"role": "assistant", "tool_calls": [
        {"id": "c1", "function": {"name": "f", "arguments": {}}}]},
      {"role": "tool", "tool_call_id": "c9", "content": "42"}, {"role": "assistant", "content": "ok"}],
     "messages[2].tool_call_id: 'c9' answers no call"),
    ([{"role": "user", "content": "hi"}, {"role": "tool", "tool_call_id": "c1", "content": "42"}],
     "messages[1]: a tool result with no assistant tool call before it"),
    ([{"role": "developer", "content": "be brief"}, {"role": "user", "content": "hi"},
      {"role": "assistant", "content": "ok"}], "messages[0]: role 'developer' is not one of"),
]


def test_broken_conversations_are_refused_or_skipped_and_counted(tmp_path):
    """Chat SFT data is checked before training: each broken record names file:line and the
    field; with data.chat.on_bad_record=skip they are counted and the good ones train."""
    from k3jax.chat.packing import read_conversations
    from k3jax.errors import InputError
    from k3jax.train.data import ChatDataset
    good = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "tool_calls": [
        {"id": "c1", "function": {"name": "f", "arguments": '{"x": 1}'}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "42"}, {"role": "assistant", "content": "42 it is"}]}
    rows = [good] + [{"messages": m} for m, _ in BAD_CHATS]
    path = tmp_path / "chat.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    conversations = read_conversations(str(path))
    tok, opts = ByteTokenizer(), {"train_on": "all", "thinking": True, "thinking_effort": "low"}
    for (where, folder, row), (_, said) in zip(conversations[1:], BAD_CHATS):
        with pytest.raises(InputError, match=re.escape(f"{where}: {said}")):
            ChatDataset([conversations[0], (where, folder, row)], tok, 800, 511, options=opts)
    ds = ChatDataset(conversations, tok, 800, 511, options=opts, on_bad_record="skip")
    assert len(ds.skipped) == len(BAD_CHATS) and ds.stats["conversations"] == 1
    assert f"{len(BAD_CHATS)} bad records skipped" in ds.summary() and f"{path}:2:" in ds.summary()
