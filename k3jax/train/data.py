"""Documents → token ids → packed fixed-length rows → batches chosen by (seed, step).

Documents: a `.txt` file is split into documents at blank lines; a `.jsonl` file holds one
JSON object per line whose `text_key` field is a document. A directory means every .txt /
.jsonl file in it, in sorted order. Each document is encoded as bos + text + eos.

Packing: the token stream of all documents is cut into rows of T+1 tokens (inputs are the
first T, targets the last T). `segment_ids` number the document pieces within a row from 1
(0 = padding); a target counts in the loss only where it continues the same piece, so no
token is ever predicted from another document. Because the model resets KDA state, conv
tails and MLA masks at segment boundaries, a packed row's loss equals the sum of its
documents' own losses.

Order: rows are shuffled per epoch by a permutation seeded with (seed, epoch), and step s
takes global rows s·R … s·R+R−1 (R = rows per step). A batch depends only on (seed, step), so
a resumed run sees exactly the batches the uninterrupted one would have.

This is the in-memory path (`data.loader: memory`): every process holds the whole packed
corpus. k3jax/train/batches.py gives the loop one interface over it and the streamed path
(`data.loader: grain`, k3jax/train/stream.py) for corpora larger than host memory.
"""
from __future__ import annotations

import json

import numpy as np
from etils import epath


def read_documents(path: str, text_key: str = "text") -> list[str]:
    """Documents from a file or a directory, local or a URL (gs://…, read through etils.epath)."""
    p = epath.Path(path)
    if p.is_dir():
        files = sorted(str(f) for f in p.iterdir() if f.name.endswith((".txt", ".jsonl")))
        if not files:
            raise FileNotFoundError(f"{path}: no .txt or .jsonl files")
        return [d for f in files for d in read_documents(f, text_key)]
    if not p.exists():
        raise FileNotFoundError(f"dataset {path!r} not found")
    text = p.read_text(encoding="utf-8")
    if str(path).endswith(".jsonl"):
        docs = []
        for n, line in enumerate(text.splitlines(), 1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{n}: not valid JSON ({e.msg})") from None
            if not isinstance(obj, dict) or not isinstance(obj.get(text_key), str):
                raise ValueError(f"{path}:{n}: expected an object with a string {text_key!r} field")
            docs.append(obj[text_key])
    else:
        docs = [d.strip() for d in text.split("\n\n")]
    docs = [d for d in docs if d]
    if not docs:
        raise ValueError(f"{path}: no documents")
    return docs


def pack(docs_ids: list[list[int]], seq_len: int, pad_id: int):
    """Pack token lists into rows of seq_len+1. Returns (tokens, segs) int32 [R, T+1]; the
    last partial row is padded (segment 0)."""
    width = seq_len + 1
    stream = np.concatenate([np.asarray(d, np.int32) for d in docs_ids])
    doc_of = np.concatenate([np.full(len(d), i, np.int64) for i, d in enumerate(docs_ids)])
    rows = -(-len(stream) // width)
    tokens = np.full(rows * width, pad_id, np.int32)
    tokens[:len(stream)] = stream
    owner = np.full(rows * width, -1, np.int64)
    owner[:len(stream)] = doc_of
    tokens, owner = tokens.reshape(rows, width), owner.reshape(rows, width)
    # Segment ids restart at 1 in each row: a new id wherever the owning document changes.
    change = np.concatenate([np.ones((rows, 1), bool), owner[:, 1:] != owner[:, :-1]], axis=1)
    segs = np.cumsum(change, axis=1).astype(np.int32)
    segs[owner < 0] = 0
    return tokens, segs


def rows_to_batch(tokens, segs):
    """[.., T+1] rows → model inputs, targets and the loss mask."""
    inp, tgt = tokens[..., :-1], tokens[..., 1:]
    seg_in, seg_tgt = segs[..., :-1], segs[..., 1:]
    mask = (seg_in > 0) & (seg_in == seg_tgt)
    return {"tokens": inp, "targets": tgt, "segment_ids": seg_in, "loss_mask": mask.astype(np.float32)}


class PackedDataset:
    """Packed rows of a corpus and the deterministic (seed, step) → batch map."""

    def __init__(self, docs: list[str], tokenizer, seq_len: int, pad_id: int):
        if seq_len < 2:
            raise ValueError(f"seq_len must be at least 2, got {seq_len}")
        ids = [tokenizer.encode(d, bos=True, eos=True) for d in docs]
        self.tokens, self.segs = pack(ids, seq_len, pad_id)
        self.seq_len = seq_len
        self.n_tokens = int(sum(len(i) for i in ids))

    @property
    def n_rows(self) -> int:
        return self.tokens.shape[0]

    def row_indices(self, seed: int, step: int, rows_per_step: int) -> np.ndarray:
        first = step * rows_per_step
        out = np.empty(rows_per_step, np.int64)
        for i, g in enumerate(range(first, first + rows_per_step)):
            epoch, pos = divmod(g, self.n_rows)
            out[i] = self._perm(seed, epoch)[pos]
        return out

    def _perm(self, seed: int, epoch: int) -> np.ndarray:
        cache = getattr(self, "_perm_cache", None)
        if cache is None or cache[0] != (seed, epoch):
            perm = np.random.default_rng([seed, epoch]).permutation(self.n_rows)
            self._perm_cache = cache = ((seed, epoch), perm)
        return cache[1]

    def batch(self, seed: int, step: int, batch_size: int, grad_accum: int = 1) -> dict:
        """Arrays shaped [grad_accum, batch_size, T] for one optimizer step."""
        idx = self.row_indices(seed, step, batch_size * grad_accum)
        b = rows_to_batch(self.tokens[idx], self.segs[idx])
        return {k: v.reshape(grad_accum, batch_size, -1) for k, v in b.items()}

