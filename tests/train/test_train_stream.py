"""Streamed data (data.loader: grain): every document read by exactly one process, the rows
the in-memory packer makes, and a stream that resumes exactly from its saved state.
References: `data.read_documents` (the in-memory reader) and `data.pack` (the in-memory packer)."""
import collections
import json
import os
import random

import numpy as np
import pytest

from k3jax.tokenizer import ByteTokenizer
from k3jax.train import stream
from k3jax.train.data import pack, read_documents, rows_to_batch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CORPUS = os.path.join(ROOT, "data", "corpus.txt")
TOK = ByteTokenizer()


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """A folder with a .txt (runs of 2-5 blank lines, whitespace-only documents, a leading
    blank line, multi-line documents) and a .jsonl (blank lines, unicode)."""
    d = tmp_path_factory.mktemp("corpus")
    rng = random.Random(0)
    txt = "\n\n"
    for i in range(300):
        txt += f"doc {i} " + "x" * rng.randint(0, 300) + ("\nsecond line" if i % 3 == 0 else "")
        txt += "\n" * rng.choice([2, 2, 3, 5]) + (" \n\n" if i % 17 == 0 else "")
    (d / "a.txt").write_text(txt)
    with open(d / "b.jsonl", "w") as f:
        for i in range(200):
            f.write(json.dumps({"text": f"j{i} ü " + "y" * rng.randint(0, 200)}) + "\n" + ("\n" if i % 20 == 0 else ""))
    return d


def documents_read(files, n_proc, unit):
    out = []
    sizes = [os.path.getsize(f) for f in files]
    for p in range(n_proc):
        mine = stream.units(files, sizes, p, n_proc, unit)
        lo, hi = sum(sizes) * p // n_proc, sum(sizes) * (p + 1) // n_proc
        assert sum(b - a for _, a, b in mine) == hi - lo        # exactly its share of the bytes
        for f, a, b in mine:
            kind = "jsonl" if f.endswith(".jsonl") else "txt"
            with open(f, "rb") as fh:
                out += [t for raw, _, _ in stream.records(fh, kind, a, b)
                        if (t := stream.parse(raw, kind, "text", f)) is not None]
    return out


@pytest.mark.parametrize("n_proc", [1, 2, 3, 7])
@pytest.mark.parametrize("unit", [23, 1000, stream.UNIT_BYTES])
def test_every_document_is_read_by_exactly_one_process(corpus, n_proc, unit, monkeypatch):
    monkeypatch.setattr(stream, "_CHUNK", 64)    # small reads: separators split across them
    files = stream.list_files(str(corpus))
    got = documents_read(files, n_proc, unit)
    want = read_documents(str(corpus))
    assert collections.Counter(got) == collections.Counter(want)
    if n_proc == 1 and unit == stream.UNIT_BYTES:
        assert got == want                       # one process, whole files: the same order


def batches(d, n, seed=0, **kw):
    sb = stream.StreamedBatches(d, seed, TOK, **kw)
    try:
        return [sb.batch(i) for i in range(n)]
    finally:
        sb.close()


def test_streamed_rows_are_the_in_memory_packers_rows():
    d = {"path": CORPUS, "text_key": "text", "seq_len": 32, "batch_size": 2, "grad_accum": 1, "shuffle_window": 0}
    got = batches(d, 30)
    ids = [TOK.encode(x, bos=True, eos=True) for x in read_documents(CORPUS)]
    tokens, segs = pack(ids, 32, TOK.pad_id)
    want = rows_to_batch(tokens[:60], segs[:60])
    for k in want:
        np.testing.assert_array_equal(np.concatenate([b[k].reshape(-1, 32) for b in got]), want[k], err_msg=k)


def test_a_restored_stream_continues_exactly(tmp_path):
    """State after k steps, through JSON (as saved with a checkpoint), into a new pipeline:
    the following batches are the uninterrupted ones, across an epoch boundary too."""
    d = {"path": CORPUS, "text_key": "text", "seq_len": 32, "batch_size": 2, "grad_accum": 2, "shuffle_window": 16}
    full = batches(d, 100, seed=5, unit_bytes=1500)       # ~77 steps per epoch of this corpus
    for cut in (3, 80):
        sb = stream.StreamedBatches(d, 5, TOK, unit_bytes=1500)
        for i in range(cut):
            sb.batch(i)
        state = json.loads(json.dumps(sb.state()))
        sb.close()
        again = stream.StreamedBatches(d, 5, TOK, unit_bytes=1500)
        again.restore(state)
        for i in range(cut, cut + 12):
            b = again.batch(i)
            assert all(np.array_equal(b[k], full[i][k]) for k in b), (cut, i)
        again.close()
    # the seed chooses the stream
    assert not np.array_equal(full[0]["tokens"], batches(d, 1, seed=6, unit_bytes=1500)[0]["tokens"])


def test_each_process_batches_its_own_rows():
    d = {"path": CORPUS, "text_key": "text", "seq_len": 16, "batch_size": 4, "grad_accum": 1, "shuffle_window": 0}
    parts = [batches(d, 2, process_index=p, process_count=2) for p in (0, 1)]
    assert all(b["tokens"].shape == (1, 2, 16) for part in parts for b in part)
    assert not np.array_equal(parts[0][0]["tokens"], parts[1][0]["tokens"])
    from k3jax.errors import K3JaxError
    with pytest.raises(K3JaxError, match="do not split over 3 processes"):
        stream.StreamedBatches(d, 0, TOK, process_index=0, process_count=3)


def test_missing_grain_names_its_extra(monkeypatch):
    import sys

    from k3jax.errors import MissingDependency
    monkeypatch.setitem(sys.modules, "grain", None)
    with pytest.raises(MissingDependency, match=r"k3jax\[stream\]"):
        stream.StreamedBatches({"path": CORPUS, "text_key": "text", "seq_len": 8, "batch_size": 1,
                                "grad_accum": 1}, 0, TOK)
