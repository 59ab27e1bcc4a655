"""Chat generation: render the prompt, decode until `<|end_of_msg|>`, parse the reply.

The prompt ends with the generation prompt (the assistant header and the pre-opened think,
or response, element), so the model's first token continues inside it. Reasoning and answer
are streamed apart through `on_text(kind, text)`, kind 'reasoning' or 'content'.
"""
from __future__ import annotations

from k3jax.chat.parsing import ReplyStream
from k3jax.chat.rendering import render
from k3jax.chat.tokenizing import tokenize
from k3jax.tokenizer import END_OF_MSG


def prompt_ids(messages, tokenizer, tools=None, **render_options) -> list[int]:
    """Token ids of the prompt that asks for the next assistant turn."""
    return tokenize(render(messages, tools, add_generation_prompt=True, **render_options), tokenizer)


def generate_reply(cfg, params, tokenizer, messages, tools=None, *, max_new_tokens: int = 256, sampling=None,
                   thinking: bool = True, thinking_effort: str | None = "max", tool_choice=None,
                   response_format=None, images=None, image_sizes=None, on_text=None) -> tuple[dict, list[int]]:
    """(reply {'reasoning_content', 'content', 'tool_calls'}, generated ids) of the next
    assistant turn. `images`: (vision config, pixels, grid_thws, media pad id) of the
    messages' images in order, `image_sizes` their original (width, height); `on_text(kind,
    text)` sees the reply as it is decoded."""
    from k3jax.infer.generate import generate
    from k3jax.infer.sampling import SamplingParams

    ids = prompt_ids(messages, tokenizer, tools, thinking=thinking, thinking_effort=thinking_effort,
                     tool_choice=tool_choice, response_format=response_format, image_sizes=image_sizes)
    stream = ReplyStream(tokenizer, thinking)

    def on_tokens(step, new):
        if new[0] >= 0:
            reasoning, content = stream.feed([int(new[0])])
            if on_text is not None:
                if reasoning:
                    on_text("reasoning", reasoning)
                if content:
                    on_text("content", content)

    eos = tokenizer.token_id(END_OF_MSG)
    kw = dict(eos_id=eos, on_tokens=on_tokens)
    sampling = sampling or SamplingParams()
    if images is None:
        out = generate(cfg, params, [ids], max_new_tokens, sampling, **kw)[0]
    else:
        from k3jax.vision.multimodal import generate_with_images
        vcfg, pixels, grids, pad = images
        out = generate_with_images(cfg, vcfg, params, [ids], pixels, grids, max_new_tokens, sampling, pad_id=pad,
                                   **kw)[0]
    return stream.reply(), out


def sample_reply(cfg, params, tokenizer, prompt: str, max_new_tokens: int, **render_options) -> dict:
    """The greedy reply to one user message (the end-of-run sample of a chat fine-tune)."""
    from k3jax.vision.multimodal import split_params
    text, _ = split_params(params)
    return generate_reply(cfg, text, tokenizer, [{"role": "user", "content": prompt}],
                          max_new_tokens=max_new_tokens, **render_options)[0]
