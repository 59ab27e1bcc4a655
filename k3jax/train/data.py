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

Chat (`data.format: chat`, `ChatDataset`): JSONL conversations become SFT examples in K3's
own format (k3jax.chat), packed whole into rows (k3jax.chat.packing); the loss mask is the
examples' trained assistant tokens, and rows with images carry their pixels.
"""
from __future__ import annotations


import numpy as np
from etils import epath

from k3jax.errors import InputError
from k3jax.textfiles import jsonl_records, read_text


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
    if str(path).endswith(".jsonl"):
        docs = []
        for n, obj in jsonl_records(path):
            if not isinstance(obj, dict) or not isinstance(obj.get(text_key), str):
                raise InputError(f"{path}:{n}: expected an object with a string {text_key!r} field")
            docs.append(obj[text_key])
    else:
        docs = [d.strip() for d in read_text(path).split("\n\n")]
    docs = [d for d in docs if d]
    if not docs:
        raise InputError(f"{path}: no documents")
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
            raise InputError(f"seq_len must be at least 2, got {seq_len}")
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


class ChatDataset(PackedDataset):
    """Packed chat conversations (`data.format: chat`; k3jax.chat.packing): the loss covers
    the assistant tokens each conversation trains, and batches of conversations with images
    carry `images` = {'pixels': [1, L, 3, P, P], 'grid_thws': [N, 3]} of their rows' images
    in token order (the train step's multimodal batch)."""

    def __init__(self, conversations, tokenizer, seq_len: int, pad_id: int, *, options: dict,
                 truncate: bool = True, vision=None, media=None, on_bad_record: str = "error"):
        from k3jax.chat.packing import build_example, pack_examples
        if seq_len < 2:
            raise InputError(f"seq_len must be at least 2, got {seq_len}")
        self.media, grid_of = media, None
        if vision is not None:
            from k3jax.vision.preprocess import MediaConfig, resize_plan
            self.media = media = media or MediaConfig()
            kh, kw = vision.merge_kernel_size

            def merged_grid(w, h):
                plan = resize_plan(w, h, media)
                return (1, plan["grid_h"], plan["grid_w"]), (plan["grid_h"] // kh) * (plan["grid_w"] // kw)
            grid_of = merged_grid
        examples, self.skipped = [], []     # skipped: 'file:line: why' of each bad record
        for where, folder, row in conversations:
            try:
                examples.append(build_example(where, folder, row, tokenizer, options, grid_of))
            except InputError as e:
                if on_bad_record != "skip":
                    raise
                self.skipped.append(str(e))
        if not examples and self.skipped:
            raise InputError(f"no usable conversation: all {len(self.skipped)} skipped (first: {self.skipped[0]})")
        packed = pack_examples(examples, seq_len, pad_id, truncate)
        packed.stats["reasoning_dropped"] = sum(e.dropped_reasoning for e in examples)
        self.tokens, self.segs, self.train, self.images = packed.tokens, packed.segs, packed.train, packed.images
        self.stats, self.seq_len, self.n_tokens = packed.stats, seq_len, packed.stats["tokens"]
        self.has_images = any(self.images)

    def summary(self) -> str:
        s = self.stats
        return (f"chat: {s['conversations']} conversations -> {s['whole']} whole, {s['cut']} cut to "
                f"{self.seq_len + 1} tokens, {s['dropped_long'] + s['dropped_untrained']} dropped "
                f"({s['dropped_untrained']} with no trained token, {s['dropped_long']} too long); "
                f"{s['tokens']:,d} tokens ({s['trained_tokens']:,d} trained) in {self.n_rows} rows of {self.seq_len}"
                + (f"; {s['reasoning_dropped']} rendered with thinking off lost their reasoning"
                   if s["reasoning_dropped"] else "")
                + (f"; {len(self.skipped)} bad records skipped (data.chat.on_bad_record=skip; first: "
                   f"{self.skipped[0]})" if self.skipped else ""))

    def batch(self, seed: int, step: int, batch_size: int, grad_accum: int = 1) -> dict:
        idx = self.row_indices(seed, step, batch_size * grad_accum)
        b = rows_to_batch(self.tokens[idx], self.segs[idx])
        b["loss_mask"] = b["loss_mask"] * self.train[idx][..., 1:]
        out = {k: v.reshape(grad_accum, batch_size, -1) for k, v in b.items()}
        images = [im for r in idx for im in self.images[r]]
        if images:
            from k3jax.vision.preprocess import preprocess_images
            if grad_accum != 1:
                raise InputError("chat data with images needs data.grad_accum=1 (a step's image grids are static)")
            pixels, grids = preprocess_images([src for src, _ in images], self.media)
            want = np.asarray([g for _, g in images], np.int64)
            if not np.array_equal(grids, want):
                raise InputError(f"image grids {grids.tolist()} differ from the ones planned when packing "
                                 f"{want.tolist()}")
            out["images"] = {"pixels": pixels[None], "grid_thws": grids}
        return out


def build_dataset(data: dict, tokenizer, k3, path: str, media_dir: str | None = None):
    """The dataset of a resolved `data:` section: plain documents (`format: text`) or chat
    conversations (`format: chat`); `media_dir`: a checkpoint folder whose
    preprocessor_config.json sizes the images (K3's defaults otherwise)."""
    if data["format"] == "text":
        return PackedDataset(read_documents(path, data["text_key"]), tokenizer, data["seq_len"], k3.text.pad_token_id)
    from k3jax.chat.packing import read_conversations
    chat = data["chat"]
    vision = media = None
    if k3.vision is not None:
        from k3jax.vision.preprocess import MediaConfig
        vision, media = k3.vision, MediaConfig.from_dir(media_dir) if media_dir else MediaConfig()
        if "<|media_pad|>" in tokenizer.specials and tokenizer.token_id("<|media_pad|>") != k3.top.get(
                "media_placeholder_token_id", tokenizer.token_id("<|media_pad|>")):
            raise InputError(f"the tokenizer's <|media_pad|> ({tokenizer.token_id('<|media_pad|>')}) is not the "
                             f"config's media_placeholder_token_id ({k3.top['media_placeholder_token_id']})")
    options = {"train_on": chat["train_on"], "thinking": chat["thinking"], "thinking_effort": chat["thinking_effort"]}
    ds = ChatDataset(read_conversations(path), tokenizer, data["seq_len"], k3.text.pad_token_id, options=options,
                     truncate=chat["truncate"], vision=vision, media=media, on_bad_record=chat["on_bad_record"])
    if ds.has_images and data["grad_accum"] != 1:
        raise InputError(f"{path}: chat data with images needs data.grad_accum=1 (a step's image grids are static)")
    return ds
