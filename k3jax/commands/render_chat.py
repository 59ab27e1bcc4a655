"""`k3jax render-chat FILE.jsonl`: chat data as the model will see it, trained spans marked.

Each conversation is rendered in K3's XTML format (k3jax.chat) with its token count; the
tokens the loss covers are green on a terminal (markup dimmed) and between ⟦ ⟧ otherwise.
`--config` takes the tokenizer and the chat options from a train preset, exactly as
`k3jax train` would use them; `--json` prints one object per conversation: segments, ids
and loss mask (images as one `<|media_pad|>` each, before the train-time expansion).
"""
from __future__ import annotations

import json
import sys

from k3jax.errors import InputError
from k3jax.commands import number

GREEN, DIM, RESET = "\033[32m", "\033[2m", "\033[0m"
OPEN_MARK, CLOSE_MARK = "⟦", "⟧"


def register(sub):
    p = sub.add_parser("render-chat", help="render chat JSONL in K3's format with the trained spans marked")
    p.add_argument("file", help="JSONL of {'messages': [...], 'tools': [...]} rows (or a folder of them)")
    p.add_argument("--config", help="train preset whose data.tokenizer / bpe_file / chat options to use")
    p.add_argument("--tokenizer", help="'byte' (the toy vocabulary; default) or K3's tiktoken.model or the "
                                       "checkpoint folder holding it")
    p.add_argument("--thinking-effort", choices=["low", "high", "max", "none"],
                   help="effort message (default: the config's, else max); 'none' for no effort message")
    p.add_argument("--no-thinking", action="store_true", help="render with thinking off")
    p.add_argument("--train-on", choices=["all", "last"], help="train every assistant turn (default) or the last")
    p.add_argument("--limit", type=number(int, 1), default=None, help="show only the first N conversations")
    p.add_argument("--json", action="store_true", help="one JSON object per conversation")
    p.set_defaults(fn=run)


def _setup(args):
    from k3jax.tokenizer import ByteTokenizer, TiktokenTokenizer, tokenizer_for
    from k3jax.train import config as tconf
    if args.config and args.tokenizer:
        raise InputError("give either --config or --tokenizer")
    if args.config:
        from k3jax.config import load_k3
        k3 = load_k3(args.config)
        data = tconf.resolve(k3.train)["data"]
        tok = tokenizer_for(k3, data["tokenizer"], data["bpe_file"], data["pattern"])
        chat = data["chat"]
    else:
        chat = tconf.DEFAULTS["data"]["chat"]
        tok = ByteTokenizer() if args.tokenizer in (None, "byte") else TiktokenTokenizer(args.tokenizer)
    opts = {"thinking": chat["thinking"], "thinking_effort": chat["thinking_effort"], "train_on": chat["train_on"]}
    if args.no_thinking:
        opts["thinking"] = False
    if args.thinking_effort:
        opts["thinking_effort"] = None if args.thinking_effort == "none" else args.thinking_effort
    if args.train_on:
        opts["train_on"] = args.train_on
    return tok, opts


def _show(segments, flags, colour: bool) -> str:
    out, inside = [], False
    for (text, markup), trained in zip(segments, flags):
        if not colour and trained != inside:
            out.append(OPEN_MARK if trained else CLOSE_MARK)
            inside = trained
        if colour:
            style = (GREEN if trained else "") + (DIM if markup else "")
            out.append(f"{style}{text}{RESET}" if style else text)
        else:
            out.append(text)
    if inside:
        out.append(CLOSE_MARK)
    return "".join(out)


def run(args) -> int:
    from k3jax.chat import segment_ids, sft_segments
    from k3jax.chat.images import image_size, user_images
    from k3jax.chat.packing import ROW_OPTIONS, read_conversations

    tok, opts = _setup(args)
    rows = read_conversations(args.file)
    if args.limit:
        rows = rows[:args.limit]
    colour = sys.stdout.isatty() and not args.json
    total = trained_total = 0
    for where, folder, row in rows:
        row_opts = {**opts, **{k: row[k] for k in ROW_OPTIONS if k in row}}
        try:
            sizes = [image_size(s) for s in user_images(row["messages"], folder, where)]
            segments, flags = sft_segments(row["messages"], row.get("tools"), image_sizes=sizes or None, **row_opts)
        except (ValueError, KeyError, TypeError) as e:
            raise InputError(f"{where}: {e}") from None
        per = segment_ids(segments, tok)
        n = sum(map(len, per))
        n_trained = sum(len(p) for p, f in zip(per, flags) if f)
        total, trained_total = total + n, trained_total + n_trained
        if args.json:
            ids = [i for p in per for i in p]
            mask = [int(f) for p, f in zip(per, flags) for _ in p]
            print(json.dumps({"where": where, "segments": [[s.text, s.markup] for s in segments], "ids": ids,
                              "loss_mask": mask}, ensure_ascii=False))
            continue
        turns = sum(1 for a, b in zip([False] + flags, flags) if b and not a)
        print(f"── {where}: {n:,d} tokens, {n_trained:,d} trained ({turns} assistant turn{'s' * (turns != 1)}"
              f"{f', {len(sizes)} image(s)' if sizes else ''})")
        print(_show(segments, flags, colour))
        print()
    if not args.json:
        share = 100 * trained_total / max(total, 1)
        print(f"{len(rows)} conversations, {total:,d} tokens, {trained_total:,d} trained ({share:.1f}%)"
              + ("" if colour else f"; trained spans between {OPEN_MARK} {CLOSE_MARK}"))
    return 0
