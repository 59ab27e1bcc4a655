"""K3's chat format against Moonshot's encoder output (fixtures/chat/cases.jsonl) and against
segments written out by hand from CHAT_FORMAT.md: rendering, per-segment tokenization, the
SFT mask, the prefix property, and parsing replies back (round trips and malformed output)."""
import base64
import io
import json
import warnings

import pytest

from helpers import FIXTURES, need
from k3jax.chat import parse_reply, render, sft_example, tokenize
from k3jax.chat.parsing import ReplyStream
from k3jax.tokenizer import ByteTokenizer

TOK = ByteTokenizer()     # the toy layout: 258 media pad, 259 end_of_msg, 260 open, 261 close, 262 sep
O, C, S, E = "<|open|>", "<|close|>", "<|sep|>", "<|end_of_msg|>"


def cases():
    with open(need(FIXTURES / "chat" / "cases.jsonl")) as f:
        return [json.loads(line) for line in f if line.strip()]


def options(case, gen=True):
    o = {"thinking_effort": None, **case["options"]}    # absent = no effort message
    if not gen:
        o.pop("add_generation_prompt", None)
    return o


def text_of(segments) -> str:
    return "".join(t for t, _ in segments)


def xtml(*parts):
    """Hand-written segments: markers are markup, every other piece is text."""
    return [(p, p in (O, C, S, E) or p.startswith("<|media_begin|>")) for p in parts if p]


def header(tag, *attrs):
    out = [O, tag]
    for k, v in attrs:
        out += [f" {k}", '="', v, '"']
    return out + [S]


def close(tag):
    return [C, tag, S]


def message(role, body, *attrs):
    return header("message", ("role", role), *attrs) + list(body) + close("message") + [E]


# ----------------------------------------------------------------------------- fixtures

def test_fixture_cases_render_tokenize_mask_and_parse():
    for c in cases():
        o = options(c)
        segs = render(c["messages"], c["tools"], image_sizes=c["image_sizes"], **o)
        assert [tuple(s) for s in segs] == [tuple(s) for s in c["segments"]], c["name"]
        per = [TOK.encode_segment(t, m) for t, m in c["segments"]]
        assert tokenize(c["segments"], TOK) == [i for p in per for i in p], c["name"]
        if c["assistant_spans"] is None:
            continue
        ex = sft_example(c["messages"], TOK, c["tools"], image_sizes=c["image_sizes"], **o)
        want_mask = [int(any(a <= k < b for a, b in c["assistant_spans"])) for k, p in enumerate(per) for _ in p]
        assert ex["ids"] == [i for p in per for i in p] and ex["loss_mask"] == want_mask, c["name"]
        # without the generation prompt (the default): the same tokens up to it
        plain = sft_example(c["messages"], TOK, c["tools"], image_sizes=c["image_sizes"], **options(c, gen=False))
        n = len(plain["ids"])
        assert plain["ids"] == ex["ids"][:n] and plain["loss_mask"] == ex["loss_mask"][:n]
        assert (n < len(ex["ids"])) == o["add_generation_prompt"]
        assistants = [m for m in c["messages"] if m["role"] == "assistant" and not m.get("name")]
        assert len(assistants) == len(c["assistant_spans"])
        for m, (a, b) in zip(assistants, c["assistant_spans"]):
            span = c["segments"][a:b]
            ids = [i for p in per[a:b] for i in p]
            for reply in (parse_reply(text_of(span), thinking=o["thinking"]),
                          parse_reply(ids, thinking=o["thinking"], tokenizer=TOK)):
                assert_reply_is(reply, m, o["thinking"])


def assert_reply_is(reply, m, thinking=True):
    assert reply["content"] == (m.get("content") or "")
    assert reply["reasoning_content"] == ((m.get("reasoning_content") or "") if thinking else "")
    calls = m.get("tool_calls") or []
    assert [c["function"]["name"] for c in reply["tool_calls"]] == [c["function"]["name"] for c in calls]
    for got, want in zip(reply["tool_calls"], calls):
        args = want["function"]["arguments"]
        assert json.loads(got["function"]["arguments"]) == (json.loads(args) if isinstance(args, str) else args)
        assert got["type"] == "function" and got["id"]


def test_prefix_property_on_the_fixture_conversations():
    """A prompt with the generation prompt is a token prefix of the conversation that goes on
    with the assistant's reply, for every unnamed assistant turn."""
    for c in cases():
        o = options(c, gen=False)
        if o.get("tool_choice") or o.get("response_format"):
            continue
        msgs = c["messages"]
        sizes = c["image_sizes"]
        full = tokenize(render(msgs, c["tools"], add_generation_prompt=False, image_sizes=sizes, **o), TOK)
        for k, m in enumerate(msgs):
            if m["role"] == "assistant" and not m.get("name"):
                n_img = sum(1 for x in msgs[:k] for p in (x["content"] if isinstance(x["content"], list) else [])
                            if p.get("type") in ("image", "image_url"))
                prompt = tokenize(render(msgs[:k], c["tools"], image_sizes=sizes[:n_img] if sizes else None, **o), TOK)
                assert full[:len(prompt)] == prompt, (c["name"], k)


# ----------------------------------------------------------------------------- by hand

def test_names_escaping_and_system_user_assistant():
    msgs = [{"role": "system", "content": "Be brief.", "name": 'ops "A" & B'},
            {"role": "user", "content": [{"type": "text", "text": "a<b>"}, {"type": "text", "text": "\nc"}]},
            {"role": "assistant", "reasoning": "  r  ", "content": None},
            {"role": "assistant", "reasoning_content": "   ", "content": "x", "name": "bot"}]
    got = render(msgs, thinking_effort=None, add_generation_prompt=False)
    want = xtml(*message("system", ["Be brief."], ("name", "ops &quot;A&quot; &amp; B")),
                *message("user", ["a<b>", "\nc"]),
                *message("assistant", [*header("think"), "  r  ", *close("think"), *header("response"),
                                       *close("response")]),
                *message("assistant", [*header("think"), *close("think"), *header("response"), "x",
                                       *close("response")], ("name", "bot")))
    assert [tuple(s) for s in got] == want


def test_tools_lazy_declarations_calls_and_results():
    params = {"type": "object", "b": 1, "a": [{"z": 0, "y": 1}]}
    tools = [{"type": "function", "function": {"name": "f", "parameters": params}}]
    lazy = [{"type": "function", "function": {"name": "g", "description": "é"}}]
    msgs = [
        {"role": "user", "content": "go"},
        {"role": "assistant", "content": "", "tool_calls": [
            {"id": "A", "type": "function", "function": {"name": "f", "arguments": {"q": 'say "hi"', "n": 2, "x": None,
                                                                                      "ok": True, "l": [1, "two"]}}},
            {"id": "B", "type": "function", "function": {"name": "g", "arguments": "{not json"}},
            {"id": "C", "type": "function", "function": {"name": "f", "arguments": "  "}}]},
        # results out of order, matched by id: put in call order, named from the calls
        {"role": "tool", "tool_call_id": "C", "content": "rc"},
        {"role": "tool", "tool_call_id": "A", "content": "ra", "name": "stale"},
        {"role": "tool", "tool_call_id": "B", "content": "rb"},
        {"role": "system", "tools": lazy, "content": "dropped"},
        {"role": "user", "content": "more"},
        # an unmatched id keeps the order; index counts on after a user message
        {"role": "tool", "tool_call_id": "zzz", "content": "late"},
    ]
    decl = ('# Tools\nHere are the available tools, described in JSONSchema.\n\n```json\n'
            '[{"function":{"name":"f","parameters":{"a":[{"y":1,"z":0}],"b":1,"type":"object"}},'
            '"type":"function"}]\n```')
    lazy_body = ('## New Tools Available\nThe system dynamically extends the toolset via lazy-loading.\nYou have '
                 'access to all existing and extended tools.\nHere are the specs for the extended tools.\n\n```json\n'
                 '[{"function":{"description":"é","name":"g"},"type":"function"}]\n```')

    def arg(k, t, v):
        return [*header("argument", ("key", k), ("type", t)), v, *close("argument")]
    call1 = [*header("call", ("tool", "f"), ("index", "1")), *arg("q", "string", 'say "hi"'), *arg("n", "number", "2"),
             *arg("x", "null", "null"), *arg("ok", "boolean", "true"), *arg("l", "array", '[1, "two"]'),
             *close("call")]
    call2 = [*header("call", ("tool", "g"), ("index", "2")), *header("json", ("type", "object")), "{not json",
             *close("json"), *close("call")]
    call3 = [*header("call", ("tool", "f"), ("index", "3")), *close("call")]
    want = xtml(*message("system", [decl], ("type", "tool-declare")),
                *message("user", ["go"]),
                *message("assistant", [*header("response"), *close("response"), *header("tools"), *call1, *call2,
                                       *call3, *close("tools")]),
                *message("tool", ["ra"], ("tool", "f"), ("index", "1")),
                *message("tool", ["rb"], ("tool", "g"), ("index", "2")),
                *message("tool", ["rc"], ("tool", "f"), ("index", "3")),
                *message("system", [lazy_body], ("type", "tool-declare")),
                *message("user", ["more"]),
                *header("message", ("role", "assistant")), *header("response"))
    # the 4th tool message has no name and the last assistant has only 3 calls: an error
    with pytest.raises(ValueError, match="message 7 .*no tool name"):
        render(msgs, tools, thinking=False, add_generation_prompt=True)
    got = render(msgs[:-1], tools, thinking=False, add_generation_prompt=True)
    assert [tuple(s) for s in got] == want
    # the renderer leaves the caller's messages as they were
    assert msgs[3] == {"role": "tool", "tool_call_id": "A", "content": "ra", "name": "stale"}
    # a 4th result with its own name counts on from the last assistant, across the user message
    named = render(msgs[:-1] + [{"role": "tool", "name": "h", "content": "late"}], tools, thinking=False,
                   add_generation_prompt=False)
    tail = xtml(*message("tool", ["late"], ("tool", "h"), ("index", "4")))
    assert [tuple(s) for s in named[-len(tail):]] == tail
    with pytest.raises(ValueError, match="JSON object"):
        render([{"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": "[1]"}}]}])


def test_effort_tool_choice_and_response_format_notes():
    user = [{"role": "user", "content": "hi"}]
    effort = ("`thinking_effort` guides on how much to think in your thinking channel (not including the response "
              "channel), supported values include `low`, `medium`, `high`, and `max`.\nNow the system is invoked "
              "with `thinking_effort=max`.")
    json_note = ("The system is invoked with `response_format=json_object`.\nYour response must be raw JSON data "
                 "without markdown code blocks (```json) or any additional formatting.")
    got = render(user, tool_choice="none", response_format={"type": "json_object"})   # defaults: thinking, max
    want = xtml(*message("system", [effort], ("type", "thinking-effort")), *message("user", ["hi"]),
                *message("system", ["The system is invoked with `tool_choice=none`.\nYou MUST NOT call any tools in "
                                    "the next message."], ("type", "tool-choice")),
                *message("system", [json_note], ("type", "response-format")),
                *header("message", ("role", "assistant")), *header("think"))
    assert [tuple(s) for s in got] == want
    # auto / a named choice / thinking off with an effort: no notes
    assert render(user, tool_choice="auto", thinking=False) == render(user, thinking=False, thinking_effort=None)
    assert render(user, tool_choice={"type": "function", "function": {"name": "f"}}, thinking_effort=None) == \
        render(user, thinking_effort=None)
    schema = render(user, thinking_effort=None, response_format={"type": "json_schema", "json_schema": {
        "name": "n", "schema": {"type": "object", "b": [2], "a": 1}}})
    assert schema[-15].text.endswith('```json\n{"a":1,"b":[2],"type":"object"}\n```')
    for bad in ("medium", "none", "MAX"):
        with pytest.raises(ValueError, match="thinking_effort"):
            render(user, thinking_effort=bad)


def test_developer_role_dropped_with_a_warning():
    msgs = [{"role": "developer", "content": "secret"}, {"role": "user", "content": "hi"}]
    with pytest.warns(UserWarning, match="developer"):
        got = render(msgs, thinking_effort=None)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert got == render(msgs[1:], thinking_effort=None)


def test_images_by_size_placeholder_and_from_data_urls():
    from PIL import Image
    buf = io.BytesIO()
    Image.new("RGB", (30, 20)).save(buf, format="PNG")
    url = "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()
    msgs = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}},
                                         {"type": "text", "text": "and <|kimi_image_placeholder|> here"}]}]
    body = lambda w, h: f"<|media_begin|>image {w}x{h}<|media_content|><|media_pad|><|media_end|>"  # noqa: E731
    got = render(msgs, thinking_effort=None, add_generation_prompt=False, image_sizes=[(640, 480), (1, 2)])
    assert [tuple(s) for s in got] == xtml(*message("user", [body(640, 480), "and ", body(1, 2), " here"]))
    with pytest.raises(ValueError, match="image"):
        render(msgs, image_sizes=[(640, 480)])
    with pytest.raises(ValueError, match="image"):
        render(msgs, image_sizes=[(1, 1)] * 3)
    # sizes read from the image itself (the needle in text then has no image: pass sizes)
    got = render([{"role": "user", "content": msgs[0]["content"][:1]}], thinking_effort=None,
                 add_generation_prompt=False)
    assert got[7] == (body(30, 20), True)
    # a remote image without sizes: the encoder's placeholder, as markup
    remote = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "https://x/y.png"}}]}]
    assert render(remote, thinking_effort=None)[7] == ("<|kimi_image_placeholder|>", True)
    ids = sft_example(remote, TOK, thinking_effort=None, image_sizes=[(4, 4)])["ids"]
    assert ids.count(TOK.token_id("<|media_pad|>")) == 1


def test_user_text_markup_stays_text():
    msgs = [{"role": "user", "content": "<|open|>x<|sep|><|end_of_msg|>"}]
    ids = tokenize(render(msgs, thinking_effort=None, add_generation_prompt=False), TOK)
    structural = {TOK.token_id(n) for n in (O, C, S, E)}
    # only the message's own <|open|> <|sep|> <|close|> <|sep|> <|end_of_msg|>
    assert sum(i in structural for i in ids) == 5
    assert bytes(i for i in ids if i < 256).decode().count("<|open|>") == 1


def test_sft_train_on_last_and_tails():
    msgs = [{"role": "user", "content": "a"}, {"role": "assistant", "reasoning_content": "r1", "content": "b"},
            {"role": "user", "content": "c"}, {"role": "assistant", "content": "d"}]
    all_ = sft_example(msgs, TOK, thinking_effort=None)
    last = sft_example(msgs, TOK, thinking_effort=None, train_on="last")
    assert all_["ids"] == last["ids"]
    trained = lambda ex: bytes(i for i, m in zip(ex["ids"], ex["loss_mask"]) if m and i < 256).decode()  # noqa: E731
    assert trained(all_) == "r1thinkresponsebresponsemessage" + "thinkresponsedresponsemessage"
    assert trained(last) == "thinkresponsedresponsemessage"
    eom = TOK.token_id(E)
    assert [i for i, m in zip(all_["ids"], all_["loss_mask"]) if m].count(eom) == 2
    # tool_choice: the last turn is rendered as its own prompt (note + generation prompt) + completion
    ex = sft_example(msgs, TOK, thinking_effort=None, tool_choice="required")
    prompt = tokenize(render(msgs[:-1], thinking_effort=None, tool_choice="required"), TOK)
    assert ex["ids"][:len(prompt)] == prompt and sum(ex["loss_mask"][len(prompt):]) == len(ex["ids"]) - len(prompt)
    assert ex["ids"][-1] == eom
    with pytest.raises(ValueError, match="train_on"):
        sft_example(msgs, TOK, train_on="first")


# ----------------------------------------------------------------------------- parsing

def reply_segments(m, thinking=True):
    """The segments the model generates for assistant message m (after the generation prompt)."""
    segs = render([m], thinking=thinking, thinking_effort=None, add_generation_prompt=False)
    return segs[7 + 3:]


def test_round_trips_render_then_parse():
    calls = [{"id": "x", "type": "function", "function": {"name": 'we"ird&name', "arguments": {
        "s": "two words", "quote": 'he said "<|close|>argument<|sep|>"', "i": -3, "f": 0.25, "b": False, "n": None,
        "o": {"k": [1, {"z": "é"}]}, "a": [], "e": ""}}},
        {"id": "y", "type": "function", "function": {"name": "g", "arguments": '{"p": 1}'}},
        {"id": "z", "type": "function", "function": {"name": "h", "arguments": {}}}]
    for m in [{"role": "assistant", "reasoning_content": "think\nhard", "content": "answer <b>", "tool_calls": calls},
              {"role": "assistant", "content": "plain"},
              {"role": "assistant", "reasoning_content": "only thinking", "content": ""}]:
        for thinking in (True, False):
            segs = reply_segments(m, thinking)
            ids = tokenize(segs, TOK)
            assert_reply_is(parse_reply(ids, thinking=thinking, tokenizer=TOK), m, thinking)
            if m.get("tool_calls") is None:       # quoted markers defeat text-level parsing: ids only
                assert_reply_is(parse_reply(text_of(segs), thinking=thinking), m, thinking)
    raw = {"role": "assistant", "content": "", "tool_calls": [{"function": {"name": "f", "arguments": "{oops"}}]}
    got = parse_reply(text_of(reply_segments(raw)))
    assert got["tool_calls"][0]["function"] == {"name": "f", "arguments": "{oops"}


def test_malformed_replies_never_raise():
    # unclosed think: everything is reasoning
    assert parse_reply("I am still thinking <|open|>response<|sep|>hi") == \
        {"reasoning_content": "I am still thinking <|open|>response<|sep|>hi", "content": "", "tool_calls": []}
    # no think markers with thinking off: all content; a truncated header at the end is text
    assert parse_reply("just text <|open|>respo", thinking=False)["content"] == "just text <|open|>respo"
    # stray closes are ignored; text after the message's end is dropped
    r = parse_reply(f"r{C}bogus{S}{C}think{S}{O}response{S}ok{C}nothing{S}!{C}response{S}{C}message{S}{E}junk")
    assert r == {"reasoning_content": "r", "content": "ok!", "tool_calls": []}
    # a close of an outer element closes the inner ones; text between calls is dropped
    r = parse_reply(f"{C}think{S}{O}response{S}{C}response{S}{O}tools{S}noise"
                    f'{O}call tool="f" index="1"{S}{O}argument key="a" type="number"{S}7{C}call{S}'
                    f'between{O}call index="2"{S}{C}call{S}'          # no tool name: dropped
                    f'{O}call tool="g" index="3"{S}{O}argument key="b" type="number"{S}1e{C}tools{S}')
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in r["tool_calls"]] == \
        [("f", {"a": 7}), ("g", {"b": "1e"})]
    # truncated in the middle of a call: the call is not counted
    r = parse_reply(f'{C}think{S}{O}response{S}{C}response{S}{O}tools{S}{O}call tool="f" index="1"{S}{O}arg')
    assert r["tool_calls"] == []
    # close with no open at all and unknown tags: still no exception
    for junk in [C, S, E, O, f"{O}{O}{C}{C}{S}{S}", f"{C}think", "", "\ufffd", f"{O}tools{S}{O}call{S}"]:
        for thinking in (True, False):
            out = parse_reply(junk, thinking=thinking)
            assert set(out) == {"reasoning_content", "content", "tool_calls"}
            parse_reply(TOK.encode_segment(junk, True), thinking=thinking, tokenizer=TOK)


def test_ids_decide_structure_quoted_markers_stay_text():
    m = {"role": "assistant", "reasoning_content": "see <|close|>think<|sep|> typed", "content": "<|end_of_msg|>?"}
    ids = tokenize(reply_segments(m), TOK)
    assert_reply_is(parse_reply(ids, tokenizer=TOK), m)
    assert parse_reply(ids) == parse_reply(ids, tokenizer=TOK)        # the toy vocabulary by default
    assert parse_reply(text_of(reply_segments(m)))["reasoning_content"] == "see "   # text can't tell them apart


def test_reply_stream_hands_out_reasoning_then_content():
    m = {"role": "assistant", "reasoning_content": "step one, step two", "content": "done é ✓"}
    ids = tokenize(reply_segments(m), TOK)
    stream, parts = ReplyStream(TOK), {"r": "", "c": ""}
    order = []
    for i in ids:
        r, c = stream.feed([i])
        parts["r"] += r
        parts["c"] += c
        if r:
            order.append("r")
        if c:
            order.append("c")
        assert "\ufffd" not in r + c and "<|" not in r + c
    assert parts == {"r": m["reasoning_content"], "c": m["content"]} and stream.finished
    assert order.index("c") > len(order) - order[::-1].index("r") - 1      # all reasoning before any content
    assert stream.reply()["content"] == m["content"]
