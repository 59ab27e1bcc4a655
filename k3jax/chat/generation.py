"""The prompt of a chat generation: the messages rendered with the generation prompt (the
assistant header and the pre-opened think, or response, element), so the model's first
token continues inside it. Generation itself is `k3jax.infer.generator.Generator.chat`.
"""
from __future__ import annotations

from k3jax.chat.rendering import render
from k3jax.chat.tokenizing import tokenize


def prompt_ids(messages, tokenizer, tools=None, **render_options) -> list[int]:
    """Token ids of the prompt that asks for the next assistant turn."""
    return tokenize(render(messages, tools, add_generation_prompt=True, **render_options), tokenizer)
