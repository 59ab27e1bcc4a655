"""Segments → token ids: one encode per segment, special tokens allowed in markup only.

BPE never merges across segments (CHAT_FORMAT.md §2), so a prompt's ids are a prefix of the
conversation's ids that continues it. `apply_chat_template` adds no `[BOS]`; neither does this.
"""
from __future__ import annotations


def _pairs(segments):
    for k, s in enumerate(segments):
        try:
            text, markup = s
        except (TypeError, ValueError):
            raise ValueError(f"segment {k}: expected a Segment or a [text, markup] pair, got {s!r}") from None
        if not isinstance(text, str):
            raise ValueError(f"segment {k}: text must be a string, got {type(text).__name__}")
        yield text, bool(markup)


def _encoder(tokenizer):
    enc = getattr(tokenizer, "encode_segment", None)
    if enc is not None:
        return enc
    if hasattr(tokenizer, "encode_ordinary"):      # a bare tiktoken.Encoding
        return lambda text, markup: (tokenizer.encode(text, allowed_special="all") if markup
                                     else tokenizer.encode_ordinary(text))
    raise TypeError(f"{type(tokenizer).__name__} cannot encode chat segments (k3jax.tokenizer's tokenizers, or a "
                    f"tiktoken.Encoding)")


def segment_ids(segments, tokenizer) -> list[list[int]]:
    """The ids of each segment, encoded alone (`tokenizer.encode_segment`)."""
    enc = _encoder(tokenizer)
    return [enc(text, markup) for text, markup in _pairs(segments)]


def tokenize(segments, tokenizer) -> list[int]:
    """Token ids of segments as `render` returns them, or `[text, markup]` pairs."""
    return [i for ids in segment_ids(segments, tokenizer) for i in ids]
