"""Streamed training data (`data.loader: grain`): corpora larger than host memory, local or
gs://, each process reading only its share, resumable exactly.

Files: `data.path` is a .txt / .jsonl file or a folder of them (sorted by name), local or a
URL that etils.epath reads (gs:// through gcsfs). Documents are what the in-memory reader
(`data.read_documents`) makes of the same files: .txt documents are separated by blank
lines, .jsonl lines are objects with a string `text_key`.

Shares: the files' bytes, taken in order as one stream, are cut into `process_count` equal
ranges and process p reads range p only, in units of at most `unit_bytes`, each within one
file. A document belongs to the unit holding its first byte: a reader finishes the document
it started before its unit's end and skips the one its unit begins inside of, so every
document is read by exactly one process, once per epoch, and no process reads much more
than its share.

Order: each epoch visits a process's units in an order drawn from (seed, epoch, process);
documents then pass grain's window shuffle (`shuffle_window` documents), are tokenized
(bos + text + eos) and packed by grain's concat-then-split into rows of seq_len + 1 with
segment ids (the rows `data.pack` makes of the same stream), and batched per step as
[grad_accum, batch_size / process_count, seq_len].

Resume: the pipeline's state (epoch, unit, byte offset of the next document, the shuffle
window, the packer's remainder) is saved with every checkpoint, one small JSON per process
(`save_state` / `restore_state`); restored, the stream continues exactly where the saved
step left it, so a resumed run sees the batches the uninterrupted one saw. The stream is
a function of the files, seed and process count: another process count is another stream.
"""
from __future__ import annotations

import re

import numpy as np
from etils import epath

from k3jax.errors import K3JaxError, require
from k3jax.textfiles import decode, json_line
from k3jax.train.data import rows_to_batch

_SEP = {"jsonl": re.compile(rb"\n"), "txt": re.compile(rb"\n\n+")}
_CHUNK = 1 << 20
UNIT_BYTES = 64 << 20


def list_files(path: str) -> list[str]:
    """The .txt / .jsonl files of a data path (a file, or a folder: sorted by name)."""
    p = epath.Path(path)
    if p.is_dir():
        files = sorted(str(f) for f in p.iterdir() if f.name.endswith((".txt", ".jsonl")))
        if not files:
            raise FileNotFoundError(2, "no .txt or .jsonl files in the data folder", str(path))
        return files
    if not p.exists():
        raise FileNotFoundError(2, "dataset not found", str(path))
    if not str(path).endswith((".txt", ".jsonl")):
        raise K3JaxError(f"dataset {path}: expected a .txt or .jsonl file, or a folder of them")
    return [str(path)]


def units(files: list[str], sizes: list[int], process_index: int, process_count: int,
          unit_bytes: int = UNIT_BYTES) -> list[tuple[str, int, int]]:
    """(file, start, end) byte ranges process `process_index` reads: its 1/process_count of
    the files' bytes taken as one stream, cut at file ends and every `unit_bytes`."""
    total = sum(sizes)
    lo, hi = total * process_index // process_count, total * (process_index + 1) // process_count
    out, offset = [], 0
    for f, n in zip(files, sizes):
        a, b = max(lo, offset), min(hi, offset + n)
        for s in range(a, b, unit_bytes):
            out.append((f, s - offset, min(b, s + unit_bytes) - offset))
        offset += n
    return out


class _Scanner:
    """Buffered reads of one file from a byte position, searching for separators."""

    def __init__(self, f, pos: int):
        f.seek(pos)
        self.f, self.base, self.buf, self.eof = f, pos, b"", False

    def find(self, sep, at: int):
        """(start, end) of the first separator at or after absolute position `at`, or
        None at the end of the file. A greedy match touching the buffer's end may go on."""
        scan = at
        while True:
            m = sep.search(self.buf, max(scan - self.base, 0))
            if m is not None and (m.end() < len(self.buf) or self.eof):
                return self.base + m.start(), self.base + m.end()
            if self.eof:
                return None
            # search again from where a separator may start: the match touching the end
            # (it may go on), else the last bytes (a separator split across reads)
            scan = self.base + m.start() if m is not None else max(at, self.base + len(self.buf) - 2)
            chunk = self.f.read(_CHUNK)
            if chunk:
                self.buf += chunk
            else:
                self.eof = True

    def take(self, a: int, b: int) -> bytes:
        return self.buf[a - self.base:b - self.base]

    def end(self) -> int:
        return self.base + len(self.buf)

    def drop(self, upto: int) -> None:
        cut = upto - self.base
        if cut > 0:
            self.buf, self.base = self.buf[cut:], upto


def records(f, kind: str, start: int, end: int, offset: int | None = None):
    """(record bytes, record start, next record's start) for the records whose first byte
    lies in [start, end) of an open binary file, beginning at `offset` (a record start
    from an earlier pass; default: the first record starting at or after `start`)."""
    sep = _SEP[kind]
    if offset is None and start > 0:
        back = 1 if kind == "jsonl" else 2         # a separator may straddle `start`
        sc = _Scanner(f, start - back)
        m = sc.find(sep, start - back)
        if m is None:
            return
        pos = m[1]
    else:
        pos = start if offset is None else offset
        sc = _Scanner(f, pos)
    while pos < end:
        m = sc.find(sep, pos)
        rec_end, nxt = m if m is not None else (sc.end(), sc.end())
        yield sc.take(pos, rec_end), pos, nxt
        if m is None:
            return
        sc.drop(nxt)
        pos = nxt


def parse(raw: bytes, kind: str, text_key: str, name: str, at: int = 0) -> str | None:
    """The document text of the record at byte `at` of file `name` (None for a blank one),
    as `data.read_documents` reads it."""
    text = decode(raw, name, first_line=None, base=at)
    where = f"{name} (byte {at})"
    if kind == "txt":
        return text.strip() or None
    if not text.strip():
        return None
    obj = json_line(text, where)
    if not isinstance(obj, dict) or not isinstance(obj.get(text_key), str):
        raise K3JaxError(f"{where}: expected an object with a string {text_key!r} field")
    return obj[text_key] or None


def require_grain():
    return require("grain", "stream", "data.loader: grain (streamed training data)")


def document_stream(files, text_key: str, seed: int, process_index: int, process_count: int,
                    unit_bytes: int = UNIT_BYTES):
    """A grain IterDataset of {'text': str}: this process's documents, epoch after epoch."""
    grain = require_grain()
    sizes = [int(epath.Path(f).stat().length) for f in files]
    mine = units(files, sizes, process_index, process_count, unit_bytes)
    if not mine:
        raise K3JaxError(f"data {files[0]}{' ...' if len(files) > 1 else ''}: {sum(sizes)} bytes are too few "
                         f"to give each of {process_count} processes a share")

    class Iterator(grain.DatasetIterator):
        def __init__(self):
            super().__init__()
            self.epoch, self.unit, self.offset = 0, 0, None
            self._order = self._records = self._file = None

        def _open(self):
            if self._order is None:
                rng = np.random.default_rng([seed, self.epoch, process_index])
                self._order = rng.permutation(len(mine))
            f, a, b = mine[int(self._order[self.unit])]
            self._close()
            self._file = epath.Path(f).open("rb")
            self._records = records(self._file, "jsonl" if f.endswith(".jsonl") else "txt", a, b, self.offset)
            self._name = f

        def _close(self):
            if self._file is not None:
                self._file.close()
                self._file = None

        def __next__(self):
            while True:
                if self._records is None:
                    self._open()
                try:
                    raw, at, nxt = next(self._records)
                except StopIteration:
                    self._records, self.offset = None, None
                    self.unit += 1
                    if self.unit == len(mine):
                        self.epoch, self.unit, self._order = self.epoch + 1, 0, None
                    continue
                self.offset = nxt
                text = parse(raw, "jsonl" if self._name.endswith(".jsonl") else "txt", text_key, self._name, at)
                if text is not None:
                    return {"text": text}

        def get_state(self):
            return {"epoch": self.epoch, "unit": self.unit, "offset": -1 if self.offset is None else self.offset}

        def set_state(self, state):
            self._close()
            self.epoch, self.unit = int(state["epoch"]), int(state["unit"])
            self.offset = None if int(state["offset"]) < 0 else int(state["offset"])
            self._order = self._records = None

    class Documents(grain.IterDataset):
        def __iter__(self):
            return Iterator()

    return Documents()


def _jsonable(x):
    if isinstance(x, dict):
        return {str(k): _jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_jsonable(v) for v in x]
    if isinstance(x, np.generic):
        return x.item()
    if isinstance(x, np.ndarray):
        return x.tolist()
    return x


class StreamedBatches:
    """Batches for one process: `batch(step)` draws the next one (steps in order);
    `state()` / `restore(state)` carry the stream across a checkpoint; `close()` stops the
    prefetch thread."""

    loader = "grain"
    local = True         # batch(step) holds this process's rows only
    has_images = False   # streamed text documents

    def __init__(self, d: dict, seed: int, tokenizer, process_index: int = 0, process_count: int = 1,
                 unit_bytes: int = UNIT_BYTES, path: str | None = None):
        grain = require_grain()
        from grain import experimental as ge
        if d["batch_size"] % process_count:
            raise K3JaxError(f"config train.data.batch_size: {d['batch_size']} rows do not split over "
                             f"{process_count} processes (data.loader: grain reads a share per process)")
        self.files = list_files(path or d["path"])
        self.seq_len, self.accum = d["seq_len"], d["grad_accum"]
        self.local_batch = d["batch_size"] // process_count
        self.global_batch = d["batch_size"]
        ds = document_stream(self.files, d["text_key"], seed, process_index, process_count, unit_bytes)
        window = int(d.get("shuffle_window") or 0)
        if window > 1:
            ds = ge.WindowShuffleIterDataset(ds, window_size=window, seed=seed * 7919 + process_index)

        def encode(doc):
            return {"tokens": np.asarray(tokenizer.encode(doc["text"], bos=True, eos=True), np.int32)}
        ds = ge.ConcatThenSplitIterDataset(ds.map(encode), length_struct={"tokens": self.seq_len + 1})
        ds = ds.batch(self.local_batch * self.accum, drop_remainder=True)
        ds = ge.ThreadPrefetchIterDataset(ds, prefetch_buffer_size=2)
        self._grain = grain
        self._it = iter(ds)
        self._next = 0

    def describe(self) -> str:
        return (f"streamed from {len(self.files)} file(s) ({self.files[0]}{' ...' if len(self.files) > 1 else ''}); "
                f"{self.local_batch}x{self.accum} rows of {self.seq_len} per step on this process")

    def batch(self, step: int) -> dict:
        """[grad_accum, batch_size / process_count, seq_len] arrays of this process's rows."""
        if step != self._next:
            raise RuntimeError(f"streamed batches are drawn in order: asked for step {step}, next is {self._next}")
        rows = next(self._it)
        self._next += 1
        b = rows_to_batch(rows["tokens"], rows["tokens_segment_ids"].astype(np.int32))
        return {k: v.reshape(self.accum, self.local_batch, -1) for k, v in b.items()}

    def state(self) -> dict:
        return {"next_step": self._next, "iterator": _jsonable(self._it.get_state())}

    def restore(self, state: dict) -> None:
        self._it.set_state(state["iterator"])
        self._next = int(state["next_step"])

    def close(self) -> None:
        if self._it is not None:
            self._it.close()
            self._it = None
