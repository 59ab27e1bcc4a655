"""Preference pairs for DPO (`objective: dpo`): JSONL records → one row per pair.

A record is `{"prompt": [messages], "chosen": [messages], "rejected": [messages]}`, OpenAI
message dicts, with an optional `"tools"` list and, like a chat row, its own `thinking`,
`thinking_effort`, `tool_choice` or `response_format`. `prompt + chosen` and `prompt +
rejected` are rendered in K3's chat format (k3jax.chat, the SFT renderer and loss mask) and
the trained tokens are those the model generates in the *completion's* assistant turns: the
prompt's own assistant turns (few-shot history) are context. Rendering is sequential, so the
prompt's segments are a prefix of both conversations (checked), which is what lets the
reference and the policy score the same completion tokens.

A row holds one pair: the chosen conversation as segment 1, the rejected one as segment 2,
then padding (segment 0). The model restarts its state at a segment boundary, so each is
scored as if alone; both halves of a pair are always in the same row, hence the same
microbatch, and a step's batch is the `[grad_accum, batch_size, seq_len]` of SFT (batch_size
counts pairs). A pair longer than a row is dropped and counted. `ref` (filled by
k3jax.train.dpo.precompute_reference) holds the reference model's per-target log-probs of
each row, batched as `ref_logp` beside the tokens.
"""
from __future__ import annotations

import re

import numpy as np

from k3jax.chat.packing import ROW_OPTIONS, check_training_record
from k3jax.chat.rendering import render_spans
from k3jax.chat.sft import sft_segments
from k3jax.chat.tokenizing import segment_ids
from k3jax.errors import InputError
from k3jax.textfiles import jsonl_files, jsonl_records
from k3jax.train.data import PackedDataset, rows_to_batch

FIELDS = ("prompt", "chosen", "rejected")
CHOSEN, REJECTED = 1, 2          # segment ids of a row's two conversations


def read_pairs(path: str) -> list[tuple[str, dict]]:
    """(file:line, record) of each pair of a .jsonl file or a folder of them, the record's
    shape checked (the messages themselves are checked when rendered)."""
    out = []
    for file in jsonl_files(path, "preference data"):
        out += _read_pairs_of(file)
    return out


def _read_pairs_of(path: str) -> list[tuple[str, dict]]:
    out = []
    for n, row in jsonl_records(path):
        where = f"{path}:{n}"
        if not isinstance(row, dict):
            raise InputError(f"{where}: expected an object with 'prompt', 'chosen' and 'rejected' message lists")
        for key in FIELDS:
            if key not in row:
                raise InputError(f"{where}: missing '{key}' (a preference record has 'prompt', 'chosen' and "
                                 f"'rejected' message lists)")
            if not isinstance(row[key], list):
                raise InputError(f"{where}: '{key}' must be a list of messages, got {type(row[key]).__name__}")
        for key in ("chosen", "rejected"):
            if not row[key]:
                raise InputError(f"{where}: '{key}' is empty (it needs the assistant reply to score)")
        if row.get("tools") is not None and not isinstance(row["tools"], list):
            raise InputError(f"{where}: 'tools' must be a list of tool declarations")
        out.append((where, row))
    if not out:
        raise InputError(f"{path}: no preference pairs")
    return out


def _renamed(error: InputError, n_prompt: int, key: str) -> InputError:
    """An error about `messages[i]` of prompt + completion, naming the field the user wrote."""
    def name(m):
        i = int(m.group(1))
        return f"prompt[{i}]" if i < n_prompt else f"{key}[{i - n_prompt}]"
    return InputError(re.sub(r"messages\[(\d+)\]", name, str(error)))


def _has_image(messages) -> bool:
    return any(isinstance(m, dict) and isinstance(m.get("content"), list)
               and any(isinstance(p, dict) and p.get("type") in ("image", "image_url") for p in m["content"])
               for m in messages)


def completion(where: str, row: dict, key: str, tokenizer, options: dict) -> tuple[np.ndarray, np.ndarray]:
    """(ids, trained) of `prompt + row[key]`: trained marks the tokens the completion's
    assistant turns generate (sft_segments' span), never the prompt's."""
    prompt, msgs, tools = row["prompt"], row[key], row.get("tools")
    opts = {**options, **{k: row[k] for k in ROW_OPTIONS if k in row}}
    try:
        check_training_record(prompt + msgs, where)
    except InputError as e:
        raise _renamed(e, len(prompt), key) from None
    if _has_image(prompt + msgs):
        raise InputError(f"{where}: images in preference pairs are not supported (text and tool calls only)")
    render = {k: opts[k] for k in ("thinking", "thinking_effort") if k in opts}
    try:
        segments, flags = sft_segments(prompt + msgs, tools, train_on="all", **opts)
        head, _ = render_spans(prompt, tools, add_generation_prompt=False, **render)
    except (ValueError, KeyError, TypeError) as e:
        raise InputError(f"{where}: {e}") from None
    if segments[:len(head)] != head:
        raise InputError(f"{where}: the prompt does not render as a prefix of prompt + {key} (tool results split "
                         f"between them?)")
    flags = [False] * len(head) + flags[len(head):]
    ids, train = [], []
    for seg, flag in zip(segment_ids(segments, tokenizer), flags):
        ids += seg
        train += [flag] * len(seg)
    if not any(train[1:]):
        raise InputError(f"{where}: '{key}' has no assistant turn to score")
    return np.asarray(ids, np.int32), np.asarray(train, bool)


class PreferenceDataset(PackedDataset):
    """Rows of pairs (module docstring) and the (seed, step) → batch map of PackedDataset."""

    def __init__(self, pairs, tokenizer, seq_len: int, pad_id: int, *, options: dict,
                 on_bad_record: str = "error"):
        if seq_len < 2:
            raise InputError(f"seq_len must be at least 2, got {seq_len}")
        width = seq_len + 1
        kept, self.skipped, self.too_long = [], [], 0
        for where, row in pairs:
            try:
                c, r = (completion(where, row, k, tokenizer, options) for k in ("chosen", "rejected"))
            except InputError as e:
                if on_bad_record != "skip":
                    raise
                self.skipped.append(str(e))
                continue
            if len(c[0]) + len(r[0]) > width:
                self.too_long += 1
                continue
            kept.append((c, r))
        if not kept:
            raise InputError(f"no preference pair left: {len(self.skipped)} bad, {self.too_long} longer than a row "
                             f"of {width} tokens (data.seq_len + 1)"
                             + (f"; first bad: {self.skipped[0]}" if self.skipped else ""))
        R = len(kept)
        self.tokens = np.full((R, width), pad_id, np.int32)
        self.segs = np.zeros((R, width), np.int32)
        self.train = np.zeros((R, width), bool)
        for i, ((ci, ct), (ri, rt)) in enumerate(kept):
            n, m = len(ci), len(ri)
            self.tokens[i, :n], self.tokens[i, n:n + m] = ci, ri
            self.segs[i, :n], self.segs[i, n:n + m] = CHOSEN, REJECTED
            self.train[i, :n], self.train[i, n:n + m] = ct, rt
        self.seq_len, self.n_tokens = seq_len, int((self.segs > 0).sum())
        self.ref = None          # [R, seq_len] reference log-probs per target, or None (in the step / none)

    def summary(self) -> str:
        return (f"preference: {self.n_rows} pairs ({int(self.train.sum()):,d} completion tokens scored), "
                f"{self.too_long} longer than a row of {self.seq_len + 1} dropped"
                + (f"; {len(self.skipped)} bad records skipped (data.chat.on_bad_record=skip; first: "
                   f"{self.skipped[0]})" if self.skipped else ""))

    def rows(self, idx) -> dict:
        """The batch arrays of rows `idx` ([..., seq_len]): completion targets only."""
        b = rows_to_batch(self.tokens[idx], self.segs[idx])
        b["loss_mask"] = b["loss_mask"] * self.train[idx][..., 1:]
        if self.ref is not None:
            b["ref_logp"] = self.ref[idx]
        return b

    def batch(self, seed: int, step: int, batch_size: int, grad_accum: int = 1) -> dict:
        b = self.rows(self.row_indices(seed, step, batch_size * grad_accum))
        return {k: v.reshape(grad_accum, batch_size, -1) for k, v in b.items()}

    def chunks(self, batch_size: int):
        """Every row once, in order, as [1, batch_size, seq_len] batches; the last one
        padded with empty rows (segment 0, nothing scored)."""
        for a in range(0, self.n_rows, batch_size):
            idx = np.arange(a, min(a + batch_size, self.n_rows))
            b = self.rows(idx)
            short = batch_size - len(idx)
            if short:
                b = {k: np.concatenate([v, np.zeros((short,) + v.shape[1:], v.dtype)]) for k, v in b.items()}
            yield {k: v[None] for k, v in b.items()}


def build_preference(data: dict, tokenizer, k3, path: str) -> PreferenceDataset:
    """The pairs of `path` under a resolved `data:` section (its chat render options)."""
    chat = data["chat"]
    options = {"thinking": chat["thinking"], "thinking_effort": chat["thinking_effort"]}
    return PreferenceDataset(read_pairs(path), tokenizer, data["seq_len"], k3.text.pad_token_id,
                             options=options, on_bad_record=chat["on_bad_record"])

