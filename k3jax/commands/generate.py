"""`k3jax generate DIR --prompt TEXT`: prefill + cached decode, streaming the text.

DIR is an HF safetensors directory, a `k3jax convert` output, a training run directory
(its newest checkpoint) or one of its `checkpoints/N`. The work is done by the generation
front door, `k3jax.infer.generator.Generator`; this module only reads the flags. Text
(`--prompt`, `--messages`) is tokenized by `--tokenizer`, else DIR's tiktoken.model, else
the byte tokenizer of a byte-level vocabulary (≤ 512 ids, the toy configs); token ids
(`--prompt-ids`) need none. `--out` writes the generated ids as JSON for scripts.

Images (`--image FILE...`): in `--prompt` text the config's `image_placeholder` string
(K3: `<|kimi_image_placeholder|>`) marks where each image goes, else the images come first,
right after bos; `--prompt-ids` hold one `<|media_pad|>` per image. The pads are expanded
into each image's rows, prefill writes the image features there, decode runs as for text.
`--mesh PRESET` shards the params over a mesh as `k3jax logits --mesh` does.

Chat (`--messages CONV.json`, a list of OpenAI-shape messages or {"messages", "tools"};
`--tools TOOLS.json`): the prompt is rendered in K3's XTML format (k3jax.chat) with the
generation prompt, decoding stops at `<|end_of_msg|>`, and reasoning and answer stream
apart; `--json` prints {"reasoning_content", "content", "tool_calls"} instead. Images in user
messages (data URLs or files next to CONV.json) go through the vision tower.
"""
from __future__ import annotations

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
    """Prompt ids with one <|media_pad|> per image (`Generator.encode`)."""
    from k3jax.infer.generator import Generator
    return Generator(k3, None, tokenizer=tok).encode(text, n_images)


def run(args) -> int:
    from k3jax.commands import output_path
    from k3jax.infer.generator import Generator, MeshScope
    from k3jax.infer.sampling import SamplingParams

    out_path = None if args.out is None else output_path(args.out)   # checked before the long part
    sampling = SamplingParams(args.temperature, args.top_k, args.top_p, args.seed)
    chat = _read_chat(args) if args.messages else None
    mesh = MeshScope(args.mesh)
    k3, params = load(args.model_dir, args.dtype, mesh.shardings, vision=bool(args.image or (chat and chat[2])),
                      expert_format=args.expert_format)
    gen = Generator(k3, params, model_dir=args.model_dir, tokenizer=args.tokenizer, mesh=mesh)
    if chat is not None:
        return _generate_chat(args, gen, chat, sampling, out_path)
    return _generate_text(args, gen, sampling, out_path)


def _generate_text(args, gen, sampling, out_path) -> int:
    from k3jax.commands import atomic_write
    from k3jax.errors import check_token_ids
    from k3jax.vision.inputs import load_npy

    if args.prompt is not None:
        prompt = args.prompt
        gen.tokenizer                           # the tokenizer rule's error comes before any work
    else:
        prompt = load_npy(args.prompt_ids, "--prompt-ids")
        if prompt.ndim not in (1, 2):
            raise InputError(f"{args.prompt_ids}: expected integer ids [T] or [B, T], got {prompt.dtype} {prompt.shape}")
        prompt = check_token_ids(prompt, gen.cfg.vocab_size, args.prompt_ids)   # before any cast
    streaming = args.prompt is not None and out_path is None
    if streaming:
        sys.stdout.write(args.prompt)
        sys.stdout.flush()

    def show(text):
        sys.stdout.write(text)
        sys.stdout.flush()
    prompts, out = gen.complete(prompt, args.max_new_tokens, sampling, images=args.image,
                                stop_at_eos=not args.no_eos_stop, on_text=show if streaming else None)
    if streaming:
        sys.stdout.write("\n")
    if out_path:
        atomic_write(out_path, lambda f: f.write(json.dumps({"prompt_ids": prompts, "generated_ids": out}).encode()))
    elif args.prompt is None:
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


def _generate_chat(args, gen, chat, sampling, out_path) -> int:
    from k3jax.commands import atomic_write
    messages, tools, sources = chat
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
    reply, ids = gen.chat(messages, tools, max_new_tokens=args.max_new_tokens, sampling=sampling,
                          thinking=not args.no_thinking, thinking_effort=effort, images=sources or None,
                          on_text=None if args.json else on_text)
    if args.json:
        print(json.dumps(reply, ensure_ascii=False))
    else:
        sys.stdout.write("\n")
        for call in reply["tool_calls"]:
            print(f"[tool call] {json.dumps(call, ensure_ascii=False)}")
    if out_path:
        atomic_write(out_path, lambda f: f.write(json.dumps({"reply": reply, "generated_ids": ids},
                                                            ensure_ascii=False).encode()))
    return 0
