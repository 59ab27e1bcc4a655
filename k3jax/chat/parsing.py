"""A generated reply → {'reasoning_content', 'content', 'tool_calls'}; never raises on bad output.

The model's output starts inside the element the generation prompt opened: `think` with
thinking on, `response` with it off (CHAT_FORMAT.md §5). Given token ids, structure is
decided by the ids of `<|open|>` `<|close|>` `<|sep|>` `<|end_of_msg|>` alone, so marker
strings quoted in text stay text; given a string, by those strings (which text cannot then
contain).

Malformed or truncated output: a header still open at the end is text; a close that matches
no open element is ignored, one that matches an outer element closes the inner ones too;
an unclosed think is all reasoning; text between tool calls is dropped; a call counts once it
is closed and names its tool; a `json` block's raw text is the call's `arguments`;
`<|end_of_msg|>` (or closing the message) ends the reply.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass, field

from k3jax.tokenizer import CLOSE, END_OF_MSG, OPEN, SEP

MARKERS = (OPEN, CLOSE, SEP, END_OF_MSG)
_MARKER_RE = re.compile("(" + "|".join(re.escape(m) for m in MARKERS) + ")")
_ATTR_RE = re.compile(r'\s*([^\s=]+)\s*=\s*"([^"]*)"')


def unescape_attr(value: str) -> str:
    return value.replace("&quot;", '"').replace("&amp;", "&")


@dataclass
class _Element:
    tag: str
    attrs: dict
    header: str = ""                 # the raw header text, for rebuilding unclosed output as text
    children: list = field(default_factory=list)
    closed: bool = False

    def body(self) -> str:
        """The body as written, nested elements included."""
        return "".join(c if isinstance(c, str) else c.raw() for c in self.children)

    def raw(self) -> str:
        return OPEN + self.header + SEP + self.body() + (CLOSE + self.tag + SEP if self.closed else "")

    def text(self) -> str:
        """Text directly in this element (nested elements left out)."""
        return "".join(c for c in self.children if isinstance(c, str))

    def find(self, tag: str, skip=("think",)):
        for c in self.children:
            if isinstance(c, _Element):
                if c.tag == tag:
                    yield c
                if c.tag not in skip:
                    yield from c.find(tag, skip)


def _events_from_text(text: str):
    for piece in _MARKER_RE.split(text):
        if piece:
            yield piece if piece in MARKERS else ("text", piece)


def _events_from_ids(ids, tokenizer):
    marker_of = {tokenizer.token_id(m): m for m in MARKERS}
    run = []
    for i in ids:
        i = int(i)
        if i in marker_of:
            if run:
                yield ("text", tokenizer.decode(run))
                run = []
            yield marker_of[i]
        else:
            run.append(i)
    if run:
        yield ("text", tokenizer.decode(run))


def _parse_header(header: str) -> tuple[str, dict]:
    header = header.strip()
    tag, _, rest = header.partition(" ")
    return tag.strip(), {k: unescape_attr(v) for k, v in _ATTR_RE.findall(rest)}


def _build(events, thinking: bool, final: bool) -> tuple[_Element, bool]:
    """The element tree of a reply, and whether the reply finished."""
    root = _Element("message", {"role": "assistant"}, 'message role="assistant"')
    first = _Element("think" if thinking else "response", {}, "think" if thinking else "response")
    root.children.append(first)
    stack = [root, first]
    pending = None          # (marker, [text]) of a header or close name still being read

    def flush_pending_as_text():
        nonlocal pending
        if pending is not None:
            marker, parts = pending
            if marker == OPEN and stack:
                stack[-1].children.append(OPEN + "".join(parts))
            pending = None

    for ev in events:
        if isinstance(ev, tuple):
            if pending is not None:
                pending[1].append(ev[1])
            elif stack:
                stack[-1].children.append(ev[1])
            continue
        if ev == SEP and pending is not None:
            marker, parts = pending
            pending = None
            name = "".join(parts)
            if marker == OPEN:
                tag, attrs = _parse_header(name)
                el = _Element(tag, attrs, name.strip())
                stack[-1].children.append(el)
                stack.append(el)
            else:
                tag = name.strip()
                for depth in range(len(stack) - 1, -1, -1):
                    if stack[depth].tag == tag:
                        for el in stack[depth:]:
                            el.closed = True
                        del stack[depth:]
                        break
                if not stack:           # the message itself closed: the reply is over
                    return root, True
            continue
        flush_pending_as_text()
        if ev == END_OF_MSG:
            return root, True
        if ev in (OPEN, CLOSE):
            pending = (ev, [])
        # a stray <|sep|> outside a header carries nothing
    if final:
        flush_pending_as_text()
    return root, False


def _value(text: str, kind: str | None):
    if kind == "string":
        return text
    try:
        return json.loads(text)
    except (json.JSONDecodeError, ValueError):
        return text


def _tool_calls(root: _Element) -> list[dict]:
    calls = []
    for call in root.find("call"):
        name = call.attrs.get("tool")
        if not call.closed or not name:
            continue
        args = {}
        for arg in call.find("argument"):
            if "key" in arg.attrs:
                args[arg.attrs["key"]] = _value(arg.body(), arg.attrs.get("type"))
        blocks = list(call.find("json"))
        arguments = blocks[0].body() if blocks and not args else json.dumps(args, ensure_ascii=False)
        calls.append({"id": f"call_{len(calls) + 1}", "type": "function",
                      "function": {"name": name, "arguments": arguments}})
    return calls


def _reply(root: _Element) -> dict:
    thinks = [c for c in root.children if isinstance(c, _Element) and c.tag == "think"]
    responses = [c for c in root.children if isinstance(c, _Element) and c.tag == "response"]
    # an unclosed think holds the rest of the output: all of it is reasoning
    content = "".join(r.text() for r in responses) if responses else root.text()
    return {"reasoning_content": "".join(t.body() for t in thinks), "content": content,
            "tool_calls": _tool_calls(root)}


def _events(text_or_ids, tokenizer):
    if isinstance(text_or_ids, str):
        return _events_from_text(text_or_ids)
    ids = [int(i) for i in text_or_ids]
    if tokenizer is None:
        if max(ids, default=0) >= 512:
            raise TypeError("parse_reply of token ids needs tokenizer= (the one that made them)")
        from k3jax.tokenizer import ByteTokenizer
        tokenizer = ByteTokenizer()      # the toy preset's byte vocabulary
    return _events_from_ids(ids, tokenizer)


def parse_reply(text_or_ids, *, thinking: bool = True, tokenizer=None) -> dict:
    """{'reasoning_content': str, 'content': str, 'tool_calls': [{'id', 'type': 'function',
    'function': {'name', 'arguments' (a JSON string)}}]} of a generated reply: text, or token
    ids with the `tokenizer` that made them (default: the toy preset's byte vocabulary).
    `thinking`: whether the generation prompt opened `think` (else `response`)."""
    root, _ = _build(_events(text_or_ids, tokenizer), thinking, final=True)
    return _reply(root)


class ReplyStream:
    """Incremental parsing for streaming: `feed(ids)` returns the new (reasoning, content) text.

    Each call re-parses everything so far without the final-output rules (a header still
    being read is held back, as is a character still split across tokens), and returns what
    extends the text already handed out. `reply()` is `parse_reply` of all ids; `finished`
    says whether the reply has ended."""

    def __init__(self, tokenizer, thinking: bool = True):
        self.tokenizer, self.thinking = tokenizer, thinking
        self.ids: list[int] = []
        self.shown = {"reasoning_content": "", "content": ""}
        self.finished = False

    def feed(self, ids) -> tuple[str, str]:
        self.ids += [int(i) for i in ids]
        root, self.finished = _build(_events_from_ids(self.ids, self.tokenizer), self.thinking,
                                     final=False)
        now = _reply(root)
        out = []
        for key in ("reasoning_content", "content"):
            text = now[key].rstrip("\ufffd") if not self.finished else now[key]
            old = self.shown[key]
            if len(text) > len(old) and text.startswith(old):
                out.append(text[len(old):])
                self.shown[key] = text
            else:
                out.append("")
        return out[0], out[1]

    def reply(self) -> dict:
        return parse_reply(self.ids, thinking=self.thinking, tokenizer=self.tokenizer)
