"""Messages → K3's XTML segments, as the release's encoder (`encoding_k3.py`) builds them.

Spec: CHAT_FORMAT.md §2–3. An element is `<|open|>TAG[ k="v"]*<|sep|>BODY<|close|>TAG<|sep|>`
and a message is a `message` element followed by `<|end_of_msg|>`. Every piece is its own
segment: markers are markup (special tokens allowed), tag names, attribute pieces and bodies
are text; tokenization never merges across segments. Empty strings make no segment.

`render` returns the segments; `render_spans` also says where each message lies, which the
SFT mask (`sft.py`) needs.
"""
from __future__ import annotations

import json
import warnings
from typing import Any, NamedTuple

from k3jax.chat.images import image_sizes_of
from k3jax.chat.messages import call_function, in_render_order, normalize_arguments
from k3jax.tokenizer import CLOSE, END_OF_MSG, MEDIA_BEGIN, MEDIA_CONTENT, MEDIA_END, MEDIA_PAD, OPEN, SEP

IMAGE_PLACEHOLDER = "<|kimi_image_placeholder|>"
THINKING_EFFORTS = ("low", "high", "max")

EFFORT_BODY = ("`thinking_effort` guides on how much to think in your thinking channel (not including the "
               "response channel), supported values include `low`, `medium`, `high`, and `max`.\n"
               "Now the system is invoked with `thinking_effort={}`.")
TOOLS_BODY = "# Tools\nHere are the available tools, described in JSONSchema.\n\n```json\n{}\n```"
LAZY_TOOLS_BODY = ("## New Tools Available\nThe system dynamically extends the toolset via lazy-loading.\n"
                   "You have access to all existing and extended tools.\nHere are the specs for the extended "
                   "tools.\n\n```json\n{}\n```")
TOOL_CHOICE_BODY = {
    "required": "The system is invoked with `tool_choice=required`.\nYou MUST call tools in the next message.",
    "none": "The system is invoked with `tool_choice=none`.\nYou MUST NOT call any tools in the next message.",
}
JSON_OBJECT_BODY = ("The system is invoked with `response_format=json_object`.\nYour response must be raw JSON "
                    "data without markdown code blocks (```json) or any additional formatting.")
JSON_SCHEMA_BODY = ("The system is invoked with `response_format=json_schema`.\nYour response must be raw JSON "
                    "data without markdown code blocks (```json) or any additional formatting.\nThe JSON data "
                    "must match the following schema:\n```json\n{}\n```")


class Segment(NamedTuple):
    """One encode call: `markup` segments may hold special-token names, text segments never."""
    text: str
    markup: bool


class MessageSpan(NamedTuple):
    """Where message `index` (of the messages given) lies: segments [start, end); `body` is
    the first segment after its header (for an assistant, after `<|open|>message role=...<|sep|>`)."""
    index: int
    role: str
    name: Any
    start: int
    body: int
    end: int


def image_prompt(width: int, height: int) -> str:
    """The markup that stands for one image (KimiK3VisionProcessor.make_image_prompt)."""
    return f"{MEDIA_BEGIN}image {int(width)}x{int(height)}{MEDIA_CONTENT}{MEDIA_PAD}{MEDIA_END}"


def escape_attr(value) -> str:
    return str(value).replace("&", "&amp;").replace('"', "&quot;")


def deep_sort(obj):
    """Dicts sorted by key at every level (lists keep their order)."""
    if isinstance(obj, dict):
        return {k: deep_sort(v) for k, v in sorted(obj.items())}
    if isinstance(obj, list):
        return [deep_sort(v) for v in obj]
    return obj


def compact_json(value) -> str:
    return json.dumps(value, ensure_ascii=False, separators=(",", ":"))


def argument_type(value) -> str:
    if isinstance(value, bool):
        return "boolean"
    if value is None:
        return "null"
    if isinstance(value, (int, float)):
        return "number"
    if isinstance(value, str):
        return "string"
    return "object" if isinstance(value, dict) else "array"


def argument_text(value) -> str:
    # strings raw; everything else as JSON with Python's default separators ({"k": "v"})
    return value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)


class _Builder:
    """Appends segments; hands out image prompts in order."""

    def __init__(self, image_prompts: list[str] | None):
        self.segments: list[Segment] = []
        self.image_prompts, self.images_used = image_prompts, 0

    def seg(self, text, markup: bool = False):
        text = str(text)
        if text:
            self.segments.append(Segment(text, markup))

    def image(self):
        if self.image_prompts is None:       # the encoder without image prompts: the needle, as markup
            self.seg(IMAGE_PLACEHOLDER, True)
            return
        if self.images_used >= len(self.image_prompts):
            raise ValueError(f"the conversation has more images than the {len(self.image_prompts)} image size(s) "
                             f"given")
        self.seg(self.image_prompts[self.images_used], True)
        self.images_used += 1

    def text(self, text):
        """Body text; with image prompts, each literal placeholder in it becomes an image."""
        text = str(text)
        if self.image_prompts is None or IMAGE_PLACEHOLDER not in text:
            self.seg(text)
            return
        pieces = text.split(IMAGE_PLACEHOLDER)
        for k, piece in enumerate(pieces):
            self.seg(piece)
            if k < len(pieces) - 1:
                self.image()

    def open(self, tag: str, attrs=()):
        self.seg(OPEN, True)
        self.seg(tag)
        for key, value in attrs:
            self.seg(f" {key}")
            self.seg('="')
            self.seg(escape_attr(value))
            self.seg('"')
        self.seg(SEP, True)

    def close(self, tag: str):
        self.seg(CLOSE, True)
        self.seg(tag)
        self.seg(SEP, True)

    def end_message(self):
        self.close("message")
        self.seg(END_OF_MSG, True)

    def content(self, content, where: str):
        if content is None:
            return
        if isinstance(content, str):
            self.text(content)
            return
        if not isinstance(content, (list, tuple)):
            raise ValueError(f"{where}: content must be a string or a list of parts, got {type(content).__name__}")
        for k, part in enumerate(content):
            if isinstance(part, str):
                self.text(part)
            elif not isinstance(part, dict):
                raise ValueError(f"{where}, part {k}: expected an object, got {type(part).__name__}")
            elif part.get("type") in ("image", "image_url"):
                self.image()
            elif "text" in part:
                self.text(part["text"])
            else:
                raise ValueError(f"{where}, part {k}: a part of type {part.get('type')!r} needs a 'text' field")

    def system_note(self, kind: str, body: str):
        self.open("message", [("role", "system"), ("type", kind)])
        self.seg(body.strip())
        self.end_message()

    def tool_declaration(self, tools, lazy: bool = False):
        self.open("message", [("role", "system"), ("type", "tool-declare")])
        self.seg((LAZY_TOOLS_BODY if lazy else TOOLS_BODY).format(compact_json(deep_sort(tools))))
        self.end_message()

    def assistant_body(self, m: dict, thinking: bool, where: str):
        if thinking:
            reasoning = m.get("reasoning_content") or m.get("reasoning")
            self.open("think")
            if reasoning is not None and str(reasoning).strip():
                self.text(reasoning)
            self.close("think")
        self.open("response")
        self.content(m.get("content"), where)
        self.close("response")
        calls = m.get("tool_calls")
        if not calls:
            return
        self.open("tools")
        for k, call in enumerate(calls, start=1):
            w = f"{where}, tool call {k}"
            fn = call_function(call, w)
            if "name" not in fn:
                raise ValueError(f"{w}: the call has no function name")
            args, raw = normalize_arguments(fn.get("arguments"), w)
            self.open("call", [("tool", fn["name"]), ("index", k)])
            if raw is not None:
                self.open("json", [("type", "object")])
                self.text(raw)
                self.close("json")
            else:
                for key, value in args.items():
                    self.open("argument", [("key", key), ("type", argument_type(value))])
                    self.text(argument_text(value))
                    self.close("argument")
            self.close("call")
        self.close("tools")


def response_schema(response_format):
    """The schema of a json_schema response_format: `json_schema.schema`, or `.json_schema`,
    or `json_schema` itself."""
    js = response_format.get("json_schema") if isinstance(response_format, dict) else None
    if js is None:
        return None
    if isinstance(js, dict):
        return js.get("schema", js.get("json_schema", js))
    return js


def render_spans(messages, tools=None, *, add_generation_prompt: bool = True, thinking: bool = True,
                 thinking_effort: str | None = "max", tool_choice=None, response_format=None,
                 image_sizes=None) -> tuple[list[Segment], list[MessageSpan]]:
    """`render`'s segments and each rendered message's span (in the order rendered: tool
    results may have been put in call order; `index` is the message's position as given)."""
    if not isinstance(messages, (list, tuple)):
        raise ValueError(f"messages must be a list of message objects, got {type(messages).__name__}")
    if thinking_effort is not None and thinking_effort not in THINKING_EFFORTS:
        raise ValueError(f"thinking_effort={thinking_effort!r}: K3 supports {', '.join(THINKING_EFFORTS)} "
                         f"(or None for no effort message)")
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise ValueError(f"message {i}: expected an object, got {type(m).__name__}")
        if "role" not in m:
            raise ValueError(f"message {i}: no 'role'")
    if image_sizes is None:
        image_sizes = image_sizes_of(messages)
    prompts = None if image_sizes is None else [image_prompt(*_size(s, k)) for k, s in enumerate(image_sizes)]
    b = _Builder(prompts)
    spans: list[MessageSpan] = []

    if tools:
        b.tool_declaration(tools)
    if thinking and thinking_effort is not None:
        b.system_note("thinking-effort", EFFORT_BODY.format(thinking_effort))

    last_calls, n_results = None, 0
    for i, m in in_render_order(messages):
        role, where, start = m["role"], f"message {i} ({m['role']})", len(b.segments)
        if role in ("user", "system") and not (role == "system" and m.get("tools")):
            b.open("message", [("role", role)] + ([("name", m["name"])] if m.get("name") else []))
            body = len(b.segments)
            b.content(m.get("content"), where)
            b.end_message()
        elif role == "system":
            b.tool_declaration(m["tools"], lazy=True)
            body = start
        elif role == "tool":
            n_results += 1
            name = m.get("tool", m.get("name"))
            if name is None and last_calls is not None and n_results <= len(last_calls):
                name = call_function(last_calls[n_results - 1], where).get("name")
            if name is None:
                raise ValueError(f"{where}: no tool name: give the message 'tool' or 'name', or follow an "
                                 f"assistant message whose tool call {n_results} names its function")
            b.open("message", [("role", "tool"), ("tool", name), ("index", n_results)])
            body = len(b.segments)
            b.content(m.get("content"), where)
            b.end_message()
        elif role == "assistant":
            last_calls, n_results = m.get("tool_calls") or None, 0
            b.open("message", [("role", "assistant")] + ([("name", m["name"])] if m.get("name") else []))
            body = len(b.segments)
            b.assistant_body(m, thinking, where)
            b.end_message()
        else:
            warnings.warn(f"{where}: role {role!r} is not part of K3's format; the message is dropped"
                          + (" (map developer messages to system ones yourself)" if role == "developer" else ""),
                          stacklevel=3)
            continue
        spans.append(MessageSpan(i, role, m.get("name"), start, body, len(b.segments)))

    if isinstance(tool_choice, str) and tool_choice in TOOL_CHOICE_BODY:
        b.system_note("tool-choice", TOOL_CHOICE_BODY[tool_choice])
    kind = response_format.get("type", response_format) if isinstance(response_format, dict) else response_format
    if kind == "json_object":
        b.system_note("response-format", JSON_OBJECT_BODY)
    elif kind == "json_schema":
        b.system_note("response-format", JSON_SCHEMA_BODY.format(compact_json(deep_sort(response_schema(
            response_format)))))
    if add_generation_prompt:
        b.open("message", [("role", "assistant")])
        b.open("think" if thinking else "response")
    if prompts is not None and b.images_used != len(prompts):
        raise ValueError(f"{len(prompts)} image size(s) given but the conversation has {b.images_used} image(s)")
    return b.segments, spans


def _size(s, k: int) -> tuple[int, int]:
    try:
        w, h = s
        return int(w), int(h)
    except (TypeError, ValueError):
        raise ValueError(f"image_sizes[{k}] = {s!r}: expected (width, height)") from None


def render(messages, tools=None, *, add_generation_prompt: bool = True, thinking: bool = True,
           thinking_effort: str | None = "max", tool_choice=None, response_format=None,
           image_sizes=None) -> list[Segment]:
    """K3's prompt for `messages` (OpenAI shape) as segments with `.text` and `.markup`.

    `thinking_effort` low / high / max adds the effort message when thinking (None: none);
    `tool_choice` 'required' / 'none' and `response_format` json_object / json_schema add
    their notes after the messages; `image_sizes` [(W, H)] per image in order make each
    image `<|media_begin|>image WxH<|media_content|><|media_pad|><|media_end|>` (None: sizes
    read from the images given, else the encoder's `<|kimi_image_placeholder|>`). Roles
    other than system / user / assistant / tool are dropped with a warning.
    """
    return render_spans(messages, tools, add_generation_prompt=add_generation_prompt, thinking=thinking,
                        thinking_effort=thinking_effort, tool_choice=tool_choice, response_format=response_format,
                        image_sizes=image_sizes)[0]
