"""The loop's batches: one interface over the in-memory path (data.py) and the streamed one
(stream.py), chosen by `data.loader`.

    batches = make_batches(d, path, seed, tokenizer, k3, process_index, process_count)
    batches.batch(step)            # numpy [grad_accum, rows, seq_len] arrays for that step
    batches.local                  # True: rows of this process only; False: the global batch
    batches.has_images             # chat data with images: batches carry 'images' (pixels, grids)
    batches.state() / .restore()   # what a checkpoint must carry to resume (None: nothing)
    batches.close()
"""
from __future__ import annotations

import numpy as np

from k3jax.train.data import PackedDataset, build_dataset


class Recomputed:
    """A batch source whose batches follow from (seed, step) and what the loop hands it: a
    checkpoint carries nothing of it, and it holds nothing to close."""

    def state(self):
        return None

    def restore(self, state) -> None:
        pass

    def close(self) -> None:
        pass


class MemoryBatches(Recomputed):
    """The in-memory path (`data.loader: memory`, for corpora that fit in host memory and for
    tests; documents or chat conversations): every process packs the whole corpus and
    computes the global batch of a step from (seed, step) alone, so nothing needs saving
    for a resume."""

    loader = "memory"
    local = False        # batch(step) is the global batch

    def __init__(self, ds: PackedDataset, d: dict, seed: int):
        self.ds, self.d, self.seed = ds, d, seed
        self.has_images = bool(getattr(ds, "has_images", False))

    def describe(self) -> str:
        chat = f"{self.ds.summary()}\n" if hasattr(self.ds, "summary") else ""
        return chat + (f"{self.ds.n_tokens:,d} tokens in {self.ds.n_rows} packed rows of {self.d['seq_len']}; "
                f"{self.d['batch_size']}x{self.d['grad_accum']} rows per step")

    def batch(self, step: int) -> dict:
        return self.ds.batch(self.seed, step, self.d["batch_size"], self.d["grad_accum"])


def batch_spec(d: dict) -> dict:
    """Global shapes and dtypes of one step's batch, [grad_accum, batch_size, seq_len]."""
    shape = (d["grad_accum"], d["batch_size"], d["seq_len"])
    return {"tokens": (shape, np.int32), "targets": (shape, np.int32), "segment_ids": (shape, np.int32),
            "loss_mask": (shape, np.float32)}


def make_batches(d: dict, path: str, seed: int, tokenizer, k3, process_index: int = 0,
                 process_count: int = 1, media_dir: str | None = None):
    """The batches `data.loader` names: 'memory' (MemoryBatches over data.build_dataset:
    documents or chat) or 'grain' (streamed documents, each process reading its share:
    k3jax.train.stream). `media_dir`: a checkpoint folder whose preprocessor_config.json
    sizes chat images."""
    loader = d.get("loader", "memory")
    if loader == "grain":
        from k3jax.train.stream import StreamedBatches
        return StreamedBatches(d, seed, tokenizer, process_index, process_count, path=path)
    if loader != "memory":
        from k3jax.config import ConfigError
        raise ConfigError(f"config train.data.loader: {loader!r} is not one of 'memory', 'grain'")
    return MemoryBatches(build_dataset(d, tokenizer, k3, path, media_dir), d, seed)
