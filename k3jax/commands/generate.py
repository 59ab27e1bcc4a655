"""`k3jax generate DIR --prompt TEXT`: prefill + cached decode, streaming the text.

DIR is an HF safetensors directory, a `k3jax convert` output, a training run directory
(its newest checkpoint) or one of its `checkpoints/N`. Text prompts use the
byte tokenizer for byte-level vocabularies (≤ 512 ids, the toy configs); the real
163,840-id vocabulary needs the checkpoint's tokenizer file (`--tokenizer
tiktoken.model`), or token ids made with it (`--prompt-ids`). `--out` writes the
generated ids as JSON for scripts.

Images (`--image FILE...`): in `--prompt` text the config's `image_placeholder` string
(K3: `<|kimi_image_placeholder|>`) marks where each image goes, else the images come first,
right after bos; `--prompt-ids` hold one `<|media_pad|>` per image. The pads are expanded
into each image's rows, prefill writes the image features there, decode runs as for text.
`--mesh PRESET` shards the params over a mesh as `k3jax logits --mesh` does.

Chat (`--messages CONV.json`, a list of OpenAI-shape messages or {"messages", "tools"};
`--tools TOOLS.json`): the prompt is rendered in K3's XTML format (k3jax.chat) with the
generation prompt, decoding stops at `<|end_of_msg|>`, and reasoning and answer stream
apart; `--json` prints {"reasoning_content", "content", "tool_calls"} instead. Images in user
messages (data URLs or files next to CONV.json) go through the vision tower. The tokenizer is
`--tokenizer`, else DIR's tiktoken.model, else the byte vocabulary of a toy config.
"""
from __future__ import annotations

import contextlib
import json
import sys

from k3jax.errors import InputError
from k3jax.commands import add_expert_format, number


def register(sub):
    p = sub.add_parser("generate", help="prefill + cached decode; streams text or writes generated ids")
    p.add_argument("model_dir", help="HF safetensors directory, k3jax checkpoint, training run directory "
                                     "or its checkpoints/N")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", help="prompt text (byte-level vocabularies only)")
    src.add_argument("--prompt-ids", help=".npy of token ids, [T] or [B, T] (rows must be full length)")
    src.add_argument("--messages", help="JSON chat: a list of messages, or {'messages': [...], 'tools': [...]}")
    p.add_argument("--tools", help="JSON list of tool declarations (OpenAI shape) for --messages")
    p.add_argument("--thinking-effort", default="max", choices=["low", "high", "max", "none"],
                   help="--messages: K3's thinking effort message (default max; 'none' leaves it out)")
    p.add_argument("--no-thinking", action="store_true", help="--messages: answer without a think element")
    p.add_argument("--json", action="store_true",
                   help="--messages: print the reply as JSON {reasoning_content, content, tool_calls}")
    p.add_argument("--tokenizer", help="tiktoken BPE file of the real vocabulary (tiktoken.model)")
    p.add_argument("--max-new-tokens", type=number(int, 1), default=64)
    p.add_argument("--temperature", type=number(float, 0), default=0.0, help="0 = greedy")
    p.add_argument("--top-k", type=number(int, 0), default=0)
    p.add_argument("--top-p", type=number(float, 0, 1, low_open=True), default=1.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-eos-stop", action="store_true", help="keep generating past the eos token")
    p.add_argument("--out", help="write {'prompt_ids', 'generated_ids'} as JSON here")
    p.add_argument("--dtype", default=None, choices=["float32", "bfloat16"],
                   help="params and compute dtype (default: float32; a run's own training dtypes)")
    p.add_argument("--image", nargs="+", metavar="FILE", help="image files the prompt refers to, in order")
    add_expert_format(p, "held")
    p.add_argument("--mesh", default=None,
                   help="mesh preset (configs/meshes/*.yaml) or YAML path: params are sharded over it, "
                        "with 'ep' expert dispatch where its expert axis is > 1")
    p.set_defaults(fn=run)


def load(model_dir, dtype=None, shardings=None, vision=False, expert_format=None):
    """(K3Config, params) of an HF directory or k3jax checkpoint; see `load_model_dir`."""
    from k3jax.checkpoint.load import load_model_dir
    runtime = {"param_dtype": dtype, "dtype": dtype} if dtype else None
    return load_model_dir(model_dir, runtime, shardings, vision=vision, expert_format=expert_format)


def _encode(tok, k3, text: str, n_images: int) -> list[int]:
    """Prompt ids with one <|media_pad|> per image: at each image placeholder in the text,
    or after bos when the text has none."""
    from k3jax.vision.multimodal import media_pad_id
    if not n_images:
        return tok.encode(text)
    pad = media_pad_id(k3)
    marker = k3.top.get("image_placeholder") or "<|kimi_image_placeholder|>"
    pieces = text.split(marker)
    if len(pieces) == 1:
        ids = tok.encode(text)
        return ids[:1] + [pad] * n_images + ids[1:]
    ids = tok.encode(pieces[0])
    for piece in pieces[1:]:
        ids += [pad] + tok.encode(piece, bos=False)
    return ids


def run(args) -> int:
    import numpy as np

    from k3jax.commands import atomic_write, output_path
    from k3jax.errors import check_token_ids
    from k3jax.infer.generate import generate
    from k3jax.infer.sampling import SamplingParams
    from k3jax.vision.multimodal import load_npy
    from k3jax.tokenizer import ByteTokenizer

    out_path = None if args.out is None else output_path(args.out)   # checked before the long part
    sampling = SamplingParams(args.temperature, args.top_k, args.top_p, args.seed)
    mesh = shardings = None
    if args.mesh is not None:
        from k3jax import sharding
        mesh, rules = sharding.load_mesh(args.mesh)
        shardings = lambda c: sharding.param_shardings(c, mesh, rules)  # noqa: E731
    chat = _read_chat(args) if args.messages else None
    k3, params = load(args.model_dir, args.dtype, shardings, vision=bool(args.image or (chat and chat[2])),
                      expert_format=args.expert_format)
    cfg = k3.text
    if chat is not None:
        with contextlib.ExitStack() as scope:
            if mesh is not None:
                scope.enter_context(sharding.use_mesh(mesh, rules))
            return _generate_chat(args, k3, cfg, params, chat, sampling)
    images = None
    if args.image:
        from k3jax.vision.multimodal import images_from_files
        images = images_from_files(args.model_dir, k3.vision, args.image)
    tok = None
    if args.prompt is not None:
        if args.tokenizer:
            from k3jax.tokenizer import tokenizer_for
            tok = tokenizer_for(cfg, "tiktoken", args.tokenizer)
        elif cfg.vocab_size > 512:
            raise InputError(f"--prompt needs a tokenizer file: this model's vocabulary has {cfg.vocab_size:,d} ids "
                             "and only byte-level vocabularies (<= 512 ids) are built in; pass the checkpoint's "
                             "--tokenizer tiktoken.model, or token ids made with it as --prompt-ids IDS.npy")
        else:
            tok = ByteTokenizer.for_config(cfg)
        prompts = np.array([_encode(tok, k3, args.prompt, len(args.image or ()))], np.int32)
    else:
        prompts = load_npy(args.prompt_ids, "--prompt-ids")
        if prompts.ndim == 1:
            prompts = prompts[None]
        if prompts.ndim != 2:
            raise InputError(f"{args.prompt_ids}: expected integer ids [T] or [B, T], got {prompts.dtype} {prompts.shape}")
        prompts = check_token_ids(prompts, cfg.vocab_size, args.prompt_ids)   # before any cast

    stream = None
    if tok is not None and args.out is None:
        shown, new_ids = [""], []

        def print_new_text(step, ids):
            # decode everything so far and print what is new; a trailing U+FFFD is a
            # character still split across tokens, held back until it completes
            if ids[0] >= 0:
                new_ids.append(int(ids[0]))
            text = tok.decode(new_ids)
            done = text.rstrip("\ufffd")
            if len(done) > len(shown[0]) and done.startswith(shown[0]):
                sys.stdout.write(done[len(shown[0]):])
                sys.stdout.flush()
                shown[0] = done
        stream = print_new_text
        sys.stdout.write(args.prompt)
        sys.stdout.flush()
    eos = None if args.no_eos_stop else cfg.eos_token_id
    with contextlib.ExitStack() as scope:
        if mesh is not None:
            scope.enter_context(sharding.use_mesh(mesh, rules))
        if images is None:
            out = generate(cfg, params, prompts.tolist(), args.max_new_tokens, sampling, eos_id=eos,
                           on_tokens=stream)
        else:
            from k3jax.infer.generate import generate_with_images
            from k3jax.vision.multimodal import media_pad_id
            out = generate_with_images(cfg, k3.vision, params, prompts.tolist(), *images, args.max_new_tokens,
                                       sampling, pad_id=media_pad_id(k3), eos_id=eos, on_tokens=stream)
    if stream is not None:
        text = tok.decode(new_ids)
        sys.stdout.write((text[len(shown[0]):] if text.startswith(shown[0]) else "") + "\n")
    if out_path:
        atomic_write(out_path, lambda f: f.write(json.dumps({"prompt_ids": prompts.tolist(),
                                                             "generated_ids": out}).encode()))
    elif tok is None:
        for row in out:
            print(" ".join(map(str, row)))
    return 0


def _read_chat(args):
    """(messages, tools, user image sources) of --messages / --tools."""
    import os

    from k3jax.chat import user_images
    if args.image:
        raise InputError("--messages carries its images in the user messages; drop --image")

    def read(path, what):
        try:
            with open(path, encoding="utf-8") as f:
                return json.load(f)
        except json.JSONDecodeError as e:
            raise InputError(f"{what} {path}: not valid JSON ({e.msg} at line {e.lineno})") from None
    conv = read(args.messages, "--messages")
    tools = conv.get("tools") if isinstance(conv, dict) else None
    messages = conv.get("messages") if isinstance(conv, dict) else conv
    if not isinstance(messages, list) or not messages:
        raise InputError(f"--messages {args.messages}: expected a non-empty list of messages or {{'messages': [...]}}")
    if args.tools:
        tools = read(args.tools, "--tools")
        if not isinstance(tools, list):
            raise InputError(f"--tools {args.tools}: expected a list of tool declarations")
    return messages, tools, user_images(messages, os.path.dirname(os.path.abspath(args.messages)), args.messages)


def _chat_tokenizer(args, k3):
    import os

    from k3jax.tokenizer import ByteTokenizer, tokenizer_for
    path = args.tokenizer or (os.path.join(args.model_dir, "tiktoken.model")
                              if os.path.isfile(os.path.join(args.model_dir, "tiktoken.model")) else None)
    if path:
        return tokenizer_for(k3, "tiktoken", path)
    if k3.text.vocab_size > 512:
        raise InputError(f"--messages needs the tokenizer: {args.model_dir} holds no tiktoken.model; pass --tokenizer")
    return ByteTokenizer.for_config(k3)


def _generate_chat(args, k3, cfg, params, chat, sampling) -> int:
    from k3jax.chat.generation import generate_reply
    from k3jax.chat.images import image_size
    messages, tools, sources = chat
    tok = _chat_tokenizer(args, k3)
    images = sizes = None
    if sources:
        from k3jax.vision.multimodal import images_from_files, media_pad_id
        pixels, grids = images_from_files(args.model_dir, k3.vision, sources)
        images, sizes = (k3.vision, pixels, grids, media_pad_id(k3)), [image_size(s) for s in sources]
    tty = sys.stdout.isatty()
    shown = {"kind": None}

    def on_text(kind, text):
        if kind != shown["kind"]:
            label = "reasoning" if kind == "reasoning" else "answer"
            sys.stdout.write(("\n" if shown["kind"] else "") + f"[{label}]\n")
            shown["kind"] = kind
        sys.stdout.write(f"\033[2m{text}\033[0m" if tty and kind == "reasoning" else text)
        sys.stdout.flush()
    effort = None if args.thinking_effort == "none" else args.thinking_effort
    reply, ids = generate_reply(cfg, params, tok, messages, tools, max_new_tokens=args.max_new_tokens,
                                sampling=sampling, thinking=not args.no_thinking, thinking_effort=effort,
                                images=images, image_sizes=sizes, on_text=None if args.json else on_text)
    if args.json:
        print(json.dumps(reply, ensure_ascii=False))
    else:
        sys.stdout.write("\n")
        for call in reply["tool_calls"]:
            print(f"[tool call] {json.dumps(call, ensure_ascii=False)}")
    if args.out:
        import os
        tmp = f"{args.out}.tmp"
        with open(tmp, "w") as f:
            json.dump({"reply": reply, "generated_ids": ids}, f, ensure_ascii=False)
        os.replace(tmp, args.out)
    return 0
