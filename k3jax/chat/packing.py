"""Chat training data: JSONL conversations → SFT examples → packed rows that keep each whole.

A row of the JSONL file is `{"messages": [...], "tools": [...]}` (OpenAI shape; `tools`
optional), optionally with its own `thinking`, `thinking_effort`, `tool_choice` or
`response_format`, which override the config's. Images in user messages are expanded here:
each `<|media_pad|>` becomes as many pads as the image has feature rows (mask 0), and the
example keeps the image's source and grid so the batch can attach its pixels.

Packing (`pack_examples`): best fit, longest first, into rows of seq_len+1 tokens, so a
conversation that fits a row is never split; one longer than a row is cut to the row (never
inside an image's pads) or, with truncate off, dropped; one with no trained token left is
dropped. The counts are returned for the run's log.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass, field

import numpy as np

from k3jax.chat.images import image_size, user_images
from k3jax.chat.sft import sft_example
from k3jax.textfiles import jsonl_files, jsonl_records
from k3jax.errors import InputError

ROW_OPTIONS = ("thinking", "thinking_effort", "tool_choice", "response_format")


def read_conversations(path: str) -> list[tuple[str, str, dict]]:
    """(where, folder, row) of each conversation in a .jsonl file or a folder of them
    (local or a URL read through etils.epath); `where` is `file:line` for error messages."""
    out = []
    for file in jsonl_files(path, "dataset"):
        out += _read_conversations_of(file)
    return out


def _read_conversations_of(path: str) -> list[tuple[str, str, dict]]:
    out = []
    for n, row in jsonl_records(path):
        where = f"{path}:{n}"
        if not isinstance(row, dict) or not isinstance(row.get("messages"), list) or not row["messages"]:
            raise InputError(f"{where}: expected an object with a non-empty 'messages' list")
        if row.get("tools") is not None and not isinstance(row["tools"], list):
            raise InputError(f"{where}: 'tools' must be a list of tool declarations")
        out.append((where, os.path.dirname(str(path)), row))
    if not out:
        raise InputError(f"{path}: no conversations")
    return out


@dataclass
class Example:
    """One conversation's tokens (pads expanded), trained flags, and its images as
    (source, grid (t, h, w), first pad, end of pads)."""
    where: str
    ids: np.ndarray
    train: np.ndarray
    images: list = field(default_factory=list)
    dropped_reasoning: bool = False      # thinking off, so the turns' reasoning was not rendered


ROLES = ("system", "user", "assistant", "tool")


def check_training_record(messages: list, where: str) -> None:
    """What the renderer would take but a training example must not hold: roles outside K3's
    format (dropped by the renderer), assistant turns with neither content nor tool calls
    (an empty answer trained), tool-call arguments that are not a JSON object (trained
    verbatim), tool results answering no call of the assistant turn before them."""
    from k3jax.chat.messages import call_function
    calls: set | None = None          # the ids the last assistant turn's tool calls carry
    for i, m in enumerate(messages):
        at = f"{where}: messages[{i}]"
        if not isinstance(m, dict):
            raise InputError(f"{at}: a message must be an object, got {type(m).__name__}")
        role = m.get("role")
        if role not in ROLES:
            hint = " (map developer messages to system ones)" if role == "developer" else ""
            raise InputError(f"{at}: role {role!r} is not one of {', '.join(ROLES)}{hint}")
        if role == "assistant":
            tool_calls = m.get("tool_calls") or []
            content = m.get("content")
            if not tool_calls and not (content.strip() if isinstance(content, str) else content):
                raise InputError(f"{at}: an assistant turn needs 'content' or 'tool_calls' (it would train "
                                 "an empty answer)")
            calls = set()
            for j, call in enumerate(tool_calls):
                fn = call_function(call, f"{at}.tool_calls[{j}]")
                args = fn.get("arguments")
                if isinstance(args, str):
                    try:
                        args = json.loads(args) if args.strip() else None
                    except json.JSONDecodeError as e:
                        raise InputError(f"{at}.tool_calls[{j}].function.arguments: not JSON ({e.msg})") from None
                if args is not None and not isinstance(args, dict):
                    raise InputError(f"{at}.tool_calls[{j}].function.arguments: must be a JSON object, "
                                     f"got {type(args).__name__}")
                if call.get("id") is not None:
                    calls.add(str(call["id"]))
        elif role == "tool":
            if calls is None:
                raise InputError(f"{at}: a tool result with no assistant tool call before it")
            cid = m.get("tool_call_id", m.get("id"))
            if cid is not None and str(cid) not in calls:
                raise InputError(f"{at}.tool_call_id: {cid!r} answers no call of the assistant turn before it "
                                 f"(its calls: {sorted(calls) or 'none with an id'})")
        else:
            calls = None if role == "user" else calls


def build_example(where: str, base_dir: str, row: dict, tokenizer, options: dict, image_grid=None) -> Example:
    """The SFT example of one JSONL row. `options`: sft_example keywords (thinking,
    thinking_effort, train_on); `image_grid(width, height)` -> (grid, feature rows) is
    required when the conversation holds images."""
    opts = {**options, **{k: row[k] for k in ROW_OPTIONS if k in row}}
    check_training_record(row["messages"], where)
    try:
        sources = user_images(row["messages"], base_dir, where)
        sizes = [image_size(s) for s in sources]
        ex = sft_example(row["messages"], tokenizer, row.get("tools"), image_sizes=sizes or None, **opts)
    except (ValueError, KeyError, TypeError) as e:
        raise InputError(f"{where}: {e}") from None
    ids, train = np.asarray(ex["ids"], np.int32), np.asarray(ex["loss_mask"], bool)
    dropped = not opts.get("thinking", True) and any(
        isinstance(m, dict) and m.get("role") == "assistant" and (m.get("reasoning_content") or m.get("reasoning"))
        for m in row["messages"])
    if not sources:
        return Example(where, ids, train, dropped_reasoning=dropped)
    if image_grid is None:
        raise InputError(f"{where}: the conversation holds images but the model has no vision tower")
    pad = tokenizer.token_id("<|media_pad|>")
    where_pads = np.flatnonzero(ids == pad)
    if len(where_pads) != len(sources):
        raise InputError(f"{where}: {len(where_pads)} <|media_pad|> for {len(sources)} images")
    grids, reps = [], np.ones(len(ids), np.int64)
    for k, (src, (w, h)) in enumerate(zip(sources, sizes)):
        grid, rows = image_grid(w, h)
        grids.append(grid)
        reps[where_pads[k]] = rows
    ids, train = np.repeat(ids, reps), np.repeat(train, reps)
    ends = np.cumsum(reps)
    images = [(src, grid, int(ends[p] - reps[p]), int(ends[p])) for src, grid, p in zip(sources, grids, where_pads)]
    return Example(where, ids, train, images, dropped)


def _cut(ex: Example, width: int) -> Example:
    """The first `width` tokens, or fewer so that no image loses part of its pads."""
    cut = width
    for _, _, start, end in ex.images:
        if start < cut < end:
            cut = start
    return Example(ex.where, ex.ids[:cut], ex.train[:cut], [im for im in ex.images if im[3] <= cut])


@dataclass
class Packed:
    tokens: np.ndarray               # [R, W] int32
    segs: np.ndarray                 # [R, W] int32, 0 = padding
    train: np.ndarray                # [R, W] bool: the token is a trained target
    images: list                     # per row: [(source, grid)] in token order
    stats: dict


def pack_examples(examples: list[Example], seq_len: int, pad_id: int, truncate: bool = True) -> Packed:
    """Best-fit-decreasing packing into rows of seq_len+1 tokens; see the module docstring."""
    width = seq_len + 1
    stats = {"conversations": len(examples), "whole": 0, "cut": 0, "dropped_long": 0, "dropped_untrained": 0}
    kept = []
    for ex in examples:
        if len(ex.ids) > width:
            if not truncate:
                stats["dropped_long"] += 1
                continue
            ex = _cut(ex, width)
            if ex.train[1:].any():
                stats["cut"] += 1
        if not ex.train[1:].any():          # the first token is never a target
            stats["dropped_untrained"] += 1
            continue
        kept.append(ex)
    stats["whole"] = len(kept) - stats["cut"]
    if not kept:
        raise InputError(f"no conversation left to train on ({stats})")
    order = sorted(range(len(kept)), key=lambda i: (-len(kept[i].ids), i))
    rows: list[list[int]] = []
    free = []                        # free space of each row
    by_space: dict[int, list[int]] = {}
    have = 0                         # bit s set <=> some row has exactly s tokens free
    for i in order:
        need = len(kept[i].ids)
        fits = have >> need
        if fits:
            space = need + (fits & -fits).bit_length() - 1      # the tightest row that fits
            r = by_space[space].pop()
            if not by_space[space]:
                have &= ~(1 << space)
        else:
            r, space = len(rows), width
            rows.append([])
            free.append(width)
        rows[r].append(i)
        free[r] = space - need
        by_space.setdefault(free[r], []).append(r)
        have |= 1 << free[r]
    R = len(rows)
    tokens = np.full((R, width), pad_id, np.int32)
    segs = np.zeros((R, width), np.int32)
    train = np.zeros((R, width), bool)
    images = []
    for r, members in enumerate(rows):
        pos, row_images = 0, []
        for s, i in enumerate(members, start=1):
            ex = kept[i]
            n = len(ex.ids)
            tokens[r, pos:pos + n], segs[r, pos:pos + n], train[r, pos:pos + n] = ex.ids, s, ex.train
            row_images += [(src, grid) for src, grid, _, _ in ex.images]
            pos += n
        images.append(row_images)
    stats["rows"], stats["tokens"], stats["trained_tokens"] = R, int((segs > 0).sum()), int(train.sum())
    return Packed(tokens, segs, train, images, stats)
