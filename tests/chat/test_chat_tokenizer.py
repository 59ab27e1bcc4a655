"""Tokenizers for chat: the toy byte vocabulary with K3's chat tokens as single ids, and the real
path (a tiktoken BPE file + K3's 256 reserved names + K3's pre-tokenizer regex) on a small BPE
file made here, checked against tiktoken itself and the reference config's ids."""
import base64
import json

import pytest

from helpers import REFERENCE_CONFIG, need
from k3jax import config as C
from k3jax.chat import render, sft_example, tokenize
from k3jax.tokenizer import (CHAT_TOKENS, K3_PATTERN, MAX_RUN, ByteTokenizer, TiktokenTokenizer,
                             k3_special_tokens, split_long_runs, tokenizer_for)


def test_k3_reserved_table_matches_the_spec_and_the_release_config():
    table = k3_special_tokens()
    assert [t["id"] for t in table] == list(range(163584, 163840))
    names = {t["id"]: t["name"] for t in table}
    spec = {163584: "[BOS]", 163585: "[EOS]", 163586: "<|end_of_msg|>", 163587: "<|open|>", 163588: "<|close|>",
            163589: "<|sep|>", 163590: "[start_header_id]", 163591: "[end_header_id]", 163593: "[EOT]",
            163602: "<|media_begin|>", 163603: "<|media_content|>", 163604: "<|media_end|>",
            163605: "<|media_pad|>", 163649: "<osagent_mode>", 163838: "[UNK]", 163839: "[PAD]"}
    for i, n in names.items():
        assert n == spec.get(i, f"<|reserved_token_{i}|>")
    assert {t["name"] for t in table if not t["special"]} == {"<|open|>", "<|close|>", "<|sep|>"}
    ref = json.loads(need(REFERENCE_CONFIG).read_text())
    text = ref["text_config"]
    assert names[text["bos_token_id"]] == "[BOS]" and names[text["eos_token_id"]] == "<|end_of_msg|>"
    assert names[text["pad_token_id"]] == "[PAD]" and names[ref["media_placeholder_token_id"]] == "<|media_pad|>"
    assert text["vocab_size"] == 163840


def test_toy_byte_tokenizer_carries_chat_tokens_as_single_ids():
    k3 = C.load_k3("toy")
    tok = tokenizer_for(C.load("toy"), "byte")
    assert tok.specials == tokenizer_for(k3, "byte").specials
    ids = {n: tok.token_id(n) for n in CHAT_TOKENS}
    assert ids["<|media_pad|>"] == k3.top["media_placeholder_token_id"] == 258
    assert sorted(ids.values()) == list(range(258, 266)) and max(ids.values()) < k3.text.vocab_size
    assert {tok.bos_id, tok.eos_id, tok.pad_id}.isdisjoint(ids.values())
    text = "<|open|>a<|media_begin|>é<|sep|>"
    assert tok.encode_segment(text, True) == [ids["<|open|>"], 97, ids["<|media_begin|>"], 0xC3, 0xA9, ids["<|sep|>"]]
    assert tok.encode_segment(text, False) == list(text.encode())
    assert tok.encode(text, bos=False) == list(text.encode())        # plain documents never get chat ids
    assert tok.decode(tok.encode_segment(text, True), specials=True) == text
    assert tok.decode(tok.encode_segment(text, True)) == "aé"
    # plain-text training keeps its ids
    assert tok.encode("Hi", bos=True, eos=True) == [256, 72, 105, 257]
    # a vocabulary with no room for chat tokens still encodes plain text
    small = ByteTokenizer(bos_id=256, eos_id=257, pad_id=258, vocab_size=260)
    assert small.encode("x") == [256, 120]
    with pytest.raises(KeyError, match="free ids"):
        small.token_id("<|sep|>")


def _bpe_file(tmp_path, extra=()):
    ranks = [bytes([i]) for i in range(256)] + [b"oW", b"me", b"ss", b"ssa", b"ge", b" r", b"ol", b"ab"]
    ranks += list(extra)
    path = tmp_path / "tiktoken.model"
    path.write_text("".join(f"{base64.b64encode(t).decode()} {i}\n" for i, t in enumerate(ranks)))
    return path, len(ranks)


def test_real_tokenizer_path_on_a_small_bpe_file(tmp_path):
    tiktoken = pytest.importorskip("tiktoken")
    from tiktoken.load import load_tiktoken_bpe
    path, n_base = _bpe_file(tmp_path)
    # a checkpoint folder is enough; 'auto' picks tiktoken once bpe_file is set
    cfg = C.load("toy").replace(vocab_size=n_base + 256, bos_token_id=n_base, eos_token_id=n_base + 2,
                                pad_token_id=n_base + 255)
    tok = tokenizer_for(cfg, "auto", str(tmp_path))
    assert isinstance(tok, TiktokenTokenizer) and tok.vocab_size == n_base + 256
    for k, t in enumerate(k3_special_tokens()):        # K3's names at K3's offsets above the ranks
        name = t["name"] if not t["name"].startswith("<|reserved_token_") else f"<|reserved_token_{n_base + k}|>"
        assert tok.specials[name] == n_base + k
    # the reference: tiktoken with K3's regex and specials, per segment
    ref = tiktoken.Encoding(name="ref", pat_str=K3_PATTERN, mergeable_ranks=load_tiktoken_bpe(str(path)),
                            special_tokens=tok.specials)
    msgs = [{"role": "user", "content": "HelloWorld <|open|>message 中文abc"},
            {"role": "assistant", "reasoning_content": "ab", "content": "meme"}]
    segs = render(msgs, thinking_effort=None)
    ids = tokenize(segs, tok)
    want = [i for s in segs for i in (ref.encode(s.text, allowed_special="all") if s.markup
                                      else ref.encode(s.text, disallowed_special=()))]
    assert ids == want == tokenize(segs, ref)        # a bare tiktoken.Encoding encodes per segment too
    # <|open|> is one id per markup <|open|> (4 elements + the generation prompt's 2); the user's stays text
    assert ids.count(n_base + 3) == 6 == sum(s == ("<|open|>", True) for s in segs)
    assert tok.decode(ids, specials=True) == "".join(s.text for s in segs)
    # the prefix property on the BPE path: the prompt's ids begin the conversation's ids
    prompt = tokenize(render(msgs[:1], thinking_effort=None), tok)
    assert tokenize(render(msgs, add_generation_prompt=False, thinking_effort=None), tok)[:len(prompt)] == prompt
    # sft on the real path: every trained token is an assistant token and the mask ends on <|end_of_msg|>
    ex = sft_example(msgs, tok, thinking_effort="low")
    assert ex["ids"][-1] == tok.token_id("<|end_of_msg|>") and ex["loss_mask"][-1] == 1


def test_k3_regex_pieces(tmp_path):
    pytest.importorskip("tiktoken")
    han = "中".encode()
    path, n_base = _bpe_file(tmp_path, extra=[han[:2], han, han + b"a"])      # merges up to '中a'
    tok = TiktokenTokenizer(str(path))
    assert tok.bos_id == n_base and tok.eos_id == n_base + 2 and tok.pad_id == n_base + 255
    assert tok.encode_segment("中a", False) == [n_base - 2, ord("a")]     # Han runs split from letters
    old = TiktokenTokenizer(str(path), pattern=r"\S+|\s+")
    assert old.encode_segment("中a", False) == [n_base - 1]              # the same merge, without the split
    # upper-then-lower words: 'HelloWorld' is two pieces, so 'oW' (rank 256) cannot merge
    assert 256 not in tok.encode_segment("HelloWorld", False)
    assert 256 in old.encode_segment("HelloWorld", False)


def test_long_runs_are_encoded_in_pieces(tmp_path):
    pytest.importorskip("tiktoken")
    path, _ = _bpe_file(tmp_path, extra=[b"aa", b"aaaa"])
    tok = TiktokenTokenizer(str(path))
    text = "a" * (MAX_RUN + 7) + " " * (2 * MAX_RUN + 1) + "b"
    pieces = list(split_long_runs(text))
    assert "".join(pieces) == text
    assert [len(p) for p in pieces] == [MAX_RUN, 7 + MAX_RUN, MAX_RUN, 2]
    assert tok.encode_segment(text, False) == [i for p in pieces for i in tok._enc.encode_ordinary(p)]
    assert list(split_long_runs("short text")) == ["short text"]
