"""`Generator`: the one front door for generation over a loaded model.

It takes text, token ids or chat messages (+ tools), images where the model has a vision
tower, sampling options and an optional tokenizer override, and streams text through a
callback. It owns the one rule that picks a model directory's tokenizer
(`pick_tokenizer`), and makes the continuous-batching engine the server runs (`engine`).

>>> g = Generator.load("runs/toy")
>>> g.generate([[256, 72, 105]], max_new_tokens=8)                     # ids in, ids out
>>> g.complete("The river ", 32, on_text=print)                       # text, streamed
>>> g.chat([{"role": "user", "content": "Hi"}], max_new_tokens=64)    # -> (reply, ids)
"""
from __future__ import annotations

import contextlib
import os

import numpy as np

from k3jax.config import ModelConfig
from k3jax.errors import InputError
from k3jax.infer.generate import generate, generate_with_images
from k3jax.infer.prefix import PrefixCache
from k3jax.infer.sampling import SamplingParams
from k3jax.tokenizer import END_OF_MSG

# The largest vocabulary the built-in byte tokenizer covers (the toy presets').
BYTE_VOCAB_MAX = 512


def pick_tokenizer(k3, model_dir=None, override: str | None = None):
    """The tokenizer of a model: `override` (a tiktoken.model file), else the model
    directory's own tiktoken.model, else the byte tokenizer of a byte-level vocabulary."""
    from k3jax.tokenizer import ByteTokenizer, tokenizer_for
    path = override
    if path is None and model_dir is not None and os.path.isfile(os.path.join(model_dir, "tiktoken.model")):
        path = os.path.join(model_dir, "tiktoken.model")
    if path:
        return tokenizer_for(k3, "tiktoken", path)
    vocab = getattr(k3, "text", k3).vocab_size
    if vocab > BYTE_VOCAB_MAX:
        raise InputError(f"text needs a tokenizer file: this model's vocabulary has {vocab:,d} ids, "
                         f"{model_dir or 'the model'} holds no tiktoken.model and only byte-level vocabularies "
                         f"(<= {BYTE_VOCAB_MAX} ids) are built in; pass --tokenizer tiktoken.model, "
                         "or token ids made with it (--prompt-ids IDS.npy)")
    return ByteTokenizer.for_config(k3)


class MeshScope:
    """A mesh preset's mesh and rules: the param shardings to load with, and the context
    every trace runs under (no preset: no mesh, one device)."""

    def __init__(self, preset=None):
        self.mesh = self.rules = None
        if preset is not None:
            from k3jax.mesh import load_mesh
            self.mesh, self.rules = load_mesh(preset)

    @classmethod
    def around(cls, mesh, rules) -> "MeshScope":
        """The scope of a mesh already made (e.g. a training run's)."""
        scope = cls()
        scope.mesh, scope.rules = mesh, rules
        return scope

    @property
    def shardings(self):
        if self.mesh is None:
            return None
        from k3jax.model import param_shardings
        return lambda c: param_shardings(c, self.mesh, self.rules)

    def __call__(self):
        if self.mesh is None:
            return contextlib.nullcontext()
        from k3jax.mesh import use_mesh
        return use_mesh(self.mesh, self.rules)


class TextStream:
    """Ids in, new text out: decodes everything so far and hands on what is new; a trailing
    U+FFFD is a character still split across tokens, held back until it completes."""

    def __init__(self, tokenizer, on_text):
        self.tokenizer, self.on_text = tokenizer, on_text
        self.ids: list[int] = []
        self.shown = ""

    def feed(self, ids):
        self.ids += [int(i) for i in ids]
        self._emit(self.tokenizer.decode(self.ids).rstrip("\ufffd"))

    def close(self):
        self._emit(self.tokenizer.decode(self.ids))

    def _emit(self, text):
        if len(text) > len(self.shown) and text.startswith(self.shown):
            self.on_text(text[len(self.shown):])
            self.shown = text


class Generator:
    """A loaded model (text config or K3Config and its params), its tokenizer by the one
    rule, the mesh its calls trace under, and an optional prefix cache."""

    def __init__(self, cfg, params, *, reuse_prefixes: bool = False, model_dir=None, tokenizer=None,
                 mesh: MeshScope | None = None):
        self.k3 = None if isinstance(cfg, ModelConfig) else cfg
        self.cfg: ModelConfig = cfg if self.k3 is None else cfg.text
        self.params, self.model_dir = params, model_dir
        self.prefixes = PrefixCache() if reuse_prefixes else None
        self.mesh = mesh or MeshScope()
        self._tokenizer_override, self._tokenizer = tokenizer, None
        if tokenizer is not None and not isinstance(tokenizer, str):
            self._tokenizer = tokenizer          # a tokenizer object, not a file

    @classmethod
    def load(cls, model_dir, *, dtype: str | None = None, mesh=None, vision: bool = False, expert_format=None,
             tokenizer: str | None = None, **kw) -> "Generator":
        """A model directory (HF, k3jax checkpoint, run directory; a LoRA run keeps its
        adapters unmerged) loaded onto `mesh` (a preset name or path, or None)."""
        from k3jax.checkpoint.load import load_model_dir
        scope = mesh if isinstance(mesh, MeshScope) else MeshScope(mesh)
        runtime = {"param_dtype": dtype, "dtype": dtype} if dtype else None
        k3, params = load_model_dir(model_dir, runtime, scope.shardings, vision=vision, expert_format=expert_format)
        return cls(k3, params, model_dir=model_dir, tokenizer=tokenizer, mesh=scope, **kw)

    @property
    def tokenizer(self):
        if self._tokenizer is None:
            self._tokenizer = pick_tokenizer(self.k3 or self.cfg, self.model_dir, self._tokenizer_override)
        return self._tokenizer

    @property
    def text_params(self):
        from k3jax.model.multimodal import split_params
        return split_params(self.params)[0]

    # -- ids ---------------------------------------------------------------------------
    def generate(self, prompts, max_new_tokens: int, sampling: SamplingParams = SamplingParams(), **kw):
        """Token id prompts (a list of rows, lengths may differ) → generated ids per row."""
        if self.prefixes is not None and len(prompts) > 1:
            return [self.generate([p], max_new_tokens, sampling, **kw)[0] for p in prompts]
        with self.mesh():
            return generate(self.cfg, self.text_params, prompts, max_new_tokens, sampling,
                            prefix_cache=self.prefixes, **kw)

    # -- text and ids, with images -------------------------------------------------------
    def encode(self, text: str, n_images: int = 0) -> list[int]:
        """Prompt ids with one <|media_pad|> per image: at each image placeholder in the
        text, or right after bos when the text has none."""
        tok = self.tokenizer
        if not n_images:
            return tok.encode(text)
        pad = self._media_pad()
        marker = (self.k3.top if self.k3 else {}).get("image_placeholder") or "<|kimi_image_placeholder|>"
        pieces = text.split(marker)
        if len(pieces) == 1:
            ids = tok.encode(text)
            return ids[:1] + [pad] * n_images + ids[1:]
        ids = tok.encode(pieces[0])
        for piece in pieces[1:]:
            ids += [pad] + tok.encode(piece, bos=False)
        return ids

    def complete(self, prompt, max_new_tokens: int, sampling: SamplingParams = SamplingParams(), *,
                 images=None, stop_at_eos: bool = True, on_text=None) -> tuple[list[list[int]], list[list[int]]]:
        """(prompt ids, generated ids), one row each, of a text prompt (one row) or token
        ids ([T] or [B, T]). `images`: image files (or sources) the prompt refers to, in
        order. `on_text(text)` sees the first row's new text as it is decoded."""
        if isinstance(prompt, str):
            prompts = [self.encode(prompt, len(images or ()))]
        else:
            rows = np.asarray(prompt)
            prompts = (rows[None] if rows.ndim == 1 else rows).tolist()
        stream = None if on_text is None else TextStream(self.tokenizer, on_text)
        kw = dict(eos_id=self.cfg.eos_token_id if stop_at_eos else None,
                  on_tokens=None if stream is None else (lambda step, ids: stream.feed([ids[0]] if ids[0] >= 0 else [])))
        if images:
            out = self._with_images(prompts, images, max_new_tokens, sampling, **kw)
        else:
            out = self.generate(prompts, max_new_tokens, sampling, **kw)
        if stream is not None:
            stream.close()
        return prompts, out

    # -- chat ------------------------------------------------------------------------------
    def chat_prompt(self, messages, tools=None, *, thinking: bool = True, thinking_effort: str | None = "max",
                    tool_choice=None, response_format=None, image_sizes=None) -> list[int]:
        """Token ids of the prompt that asks for the next assistant turn (K3's XTML)."""
        from k3jax.chat.generation import prompt_ids
        return prompt_ids(messages, self.tokenizer, tools, thinking=thinking, thinking_effort=thinking_effort,
                          tool_choice=tool_choice, response_format=response_format, image_sizes=image_sizes)

    def chat(self, messages, tools=None, *, max_new_tokens: int = 256, sampling: SamplingParams | None = None,
             thinking: bool = True, thinking_effort: str | None = "max", tool_choice=None, response_format=None,
             images=None, on_text=None) -> tuple[dict, list[int]]:
        """(reply {'reasoning_content', 'content', 'tool_calls'}, generated ids) of the next
        assistant turn, decoded until `<|end_of_msg|>`. `images`: the sources of the user
        messages' images, in order. `on_text(kind, text)`, kind 'reasoning' or 'content',
        sees the reply as it is decoded."""
        from k3jax.chat.images import image_size
        from k3jax.chat.parsing import ReplyStream
        sizes = [image_size(s) for s in images] if images else None
        ids = self.chat_prompt(messages, tools, thinking=thinking, thinking_effort=thinking_effort,
                               tool_choice=tool_choice, response_format=response_format, image_sizes=sizes)
        stream = ReplyStream(self.tokenizer, thinking)

        def on_tokens(step, new):
            if new[0] >= 0:
                reasoning, content = stream.feed([int(new[0])])
                if on_text is not None:
                    if reasoning:
                        on_text("reasoning", reasoning)
                    if content:
                        on_text("content", content)

        kw = dict(eos_id=self.tokenizer.token_id(END_OF_MSG), on_tokens=on_tokens)
        sampling = sampling or SamplingParams()
        if images:
            out = self._with_images([ids], images, max_new_tokens, sampling, **kw)[0]
        else:
            out = self.generate([ids], max_new_tokens, sampling, **kw)[0]
        return stream.reply(), out

    # -- serving -------------------------------------------------------------------------
    def engine(self, slots: int = 8, max_len: int = 512, chunk: int = 32, **kw):
        """The continuous-batching engine over this model (`k3jax.infer.engine.Engine`)."""
        from k3jax.infer.engine import Engine
        return Engine(self.cfg, self.text_params, slots=slots, max_len=max_len, chunk=chunk,
                      scope=self.mesh, **kw)

    def _media_pad(self) -> int:
        from k3jax.vision.inputs import media_pad_id
        if self.k3 is None:
            raise InputError("images need the model's K3Config (load the model directory with Generator.load)")
        return media_pad_id(self.k3)

    def _with_images(self, prompts, sources, max_new_tokens, sampling, **kw):
        from k3jax.vision.inputs import images_from_files
        pad = self._media_pad()
        if self.k3.vision is None:
            raise InputError(f"{self.model_dir or 'this model'} has no vision tower: it cannot take images")
        pixels, grids = images_from_files(self.model_dir, self.k3.vision, sources)
        with self.mesh():
            return generate_with_images(self.cfg, self.k3.vision, self.params, prompts, pixels, grids,
                                        max_new_tokens, sampling, pad_id=pad, **kw)


def generate_reply(cfg, params, tokenizer, messages, tools=None, **kw) -> tuple[dict, list[int]]:
    """`Generator.chat` for a bare (config, params, tokenizer)."""
    return Generator(cfg, params, tokenizer=tokenizer).chat(messages, tools, **kw)


def sample_reply(cfg, params, tokenizer, prompt: str, max_new_tokens: int, **render_options) -> dict:
    """The greedy reply to one user message (the end-of-run sample of a chat fine-tune)."""
    return generate_reply(cfg, params, tokenizer, [{"role": "user", "content": prompt}],
                          max_new_tokens=max_new_tokens, **render_options)[0]
