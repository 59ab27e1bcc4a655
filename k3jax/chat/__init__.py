"""K3's XTML chat format (CHAT_FORMAT.md): render, per-segment tokenization, SFT examples and
reply parsing. `render(messages, tools)` → segments; `tokenize(segments, tokenizer)` → ids;
`sft_example(messages, tokenizer)` → {'ids', 'loss_mask'}; `parse_reply(ids_or_text)` →
{'reasoning_content', 'content', 'tool_calls'}."""
from k3jax.chat.images import image_sizes_of, user_images
from k3jax.chat.messages import reorder_tool_results
from k3jax.chat.parsing import ReplyStream, parse_reply
from k3jax.chat.rendering import IMAGE_PLACEHOLDER, MessageSpan, Segment, image_prompt, render, render_spans
from k3jax.chat.sft import sft_example, sft_segments
from k3jax.chat.tokenizing import segment_ids, tokenize

__all__ = ["IMAGE_PLACEHOLDER", "MessageSpan", "ReplyStream", "Segment", "image_prompt", "image_sizes_of",
           "parse_reply", "render", "render_spans", "reorder_tool_results", "segment_ids", "sft_example",
           "sft_segments", "tokenize", "user_images"]
