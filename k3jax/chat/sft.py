"""SFT examples: a conversation's token ids and the mask of what the model itself generates.

The trained span of an assistant turn is everything after the generation prompt
(`<|open|>message role="assistant"<|sep|>` + the pre-opened `<|open|>think<|sep|>`, or
`<|open|>response<|sep|>` with thinking off) through its `<|end_of_msg|>`: by the prefix
property (CHAT_FORMAT.md §4) exactly the tokens sampled at inference. System, user and tool
messages, headers and image pads are never trained. A named assistant turn is context only:
the generation prompt carries no name, so the model never produces its header.

Tool-choice and response-format notes render after the last message, so with either one
the last assistant turn is rendered as its own prompt (`messages[:-1]` with the note and the
generation prompt) followed by its completion.
"""
from __future__ import annotations

from k3jax.chat.rendering import TOOL_CHOICE_BODY, Segment, render_spans
from k3jax.chat.tokenizing import segment_ids

GENERATION_PROMPT_BODY = 3      # <|open|> think|response <|sep|>, opened by the generation prompt


def _has_tail(tool_choice, response_format) -> bool:
    kind = response_format.get("type", response_format) if isinstance(response_format, dict) else response_format
    return (isinstance(tool_choice, str) and tool_choice in TOOL_CHOICE_BODY) or kind in ("json_object",
                                                                                         "json_schema")


def _generated(spans) -> list[tuple[int, int]]:
    return [(s.body + GENERATION_PROMPT_BODY, s.end) for s in spans if s.role == "assistant" and not s.name]


def sft_segments(messages, tools=None, *, thinking: bool = True, thinking_effort: str | None = "max",
                 tool_choice=None, response_format=None, image_sizes=None, train_on: str = "all",
                 add_generation_prompt: bool = False) -> tuple[list[Segment], list[bool]]:
    """(segments, trained flag per segment) of an SFT example; see `sft_example`."""
    if train_on not in ("all", "last"):
        raise ValueError(f"train_on={train_on!r}: expected 'all' or 'last'")
    opts = dict(thinking=thinking, thinking_effort=thinking_effort, image_sizes=image_sizes)
    tail = dict(tool_choice=tool_choice, response_format=response_format)
    last = messages[-1] if messages else None
    if _has_tail(tool_choice, response_format) and isinstance(last, dict) and last.get("role") == "assistant" \
            and not last.get("name"):
        segments, spans = render_spans(messages[:-1], tools, add_generation_prompt=True, **opts, **tail)
        full, full_spans = render_spans(messages, tools, add_generation_prompt=add_generation_prompt, **opts)
        start, end = _generated(full_spans)[-1]
        trained = _generated(spans) + [(len(segments), len(segments) + end - start)]
        segments = segments + full[start:]
    else:
        segments, spans = render_spans(messages, tools, add_generation_prompt=add_generation_prompt, **opts, **tail)
        trained = _generated(spans)
    if train_on == "last":
        trained = trained[-1:]
    flags = [False] * len(segments)
    for a, b in trained:
        flags[a:b] = [True] * (b - a)
    return segments, flags


def sft_example(messages, tokenizer, tools=None, *, thinking: bool = True, thinking_effort: str | None = "max",
                tool_choice=None, response_format=None, image_sizes=None, train_on: str = "all",
                add_generation_prompt: bool = False) -> dict:
    """{'ids', 'loss_mask'} (lists of ints) of one conversation: the encoder's tokens (one
    `<|media_pad|>` per image) and 1 on the tokens each trained assistant turn generates
    (`train_on` 'all' of them, or the 'last'). Render options as `render`'s; a generation
    prompt (off by default) is appended untrained."""
    segments, flags = sft_segments(messages, tools, thinking=thinking, thinking_effort=thinking_effort,
                                   tool_choice=tool_choice, response_format=response_format,
                                   image_sizes=image_sizes, train_on=train_on,
                                   add_generation_prompt=add_generation_prompt)
    ids, mask = [], []
    for seg, flag in zip(segment_ids(segments, tokenizer), flags):
        ids += seg
        mask += [int(flag)] * len(seg)
    return {"ids": ids, "loss_mask": mask}
