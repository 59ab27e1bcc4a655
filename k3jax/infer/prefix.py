"""Prefix reuse: caches saved after a token prefix, restored for requests that share it.

A saved entry holds everything a continuation needs, consistently from the same moment:
every KDA layer's state and conv tails, every MLA layer's latents up to the prefix's
end, and the logits after its last token. A request whose prompt starts with a saved
prefix restores it and prefills only its suffix (or nothing, on an exact match).
"""
from __future__ import annotations

from collections import OrderedDict

import jax.numpy as jnp
import numpy as np

from k3jax.config import ModelConfig
from k3jax.infer.caches import Cache, copy_cache, resize, select_rows


class PrefixCache:
    """Single-sequence snapshots keyed by their token ids; least recently used evicted."""

    def __init__(self, max_entries: int = 8):
        self.max_entries = max_entries
        self._entries: OrderedDict[tuple[int, ...], tuple[jnp.ndarray, Cache]] = OrderedDict()

    def __len__(self):
        return len(self._entries)

    def save(self, ids, cache: Cache, logits, row: int = 0):
        """Snapshot row `row` of `cache` (which must hold exactly `ids`) with its logits.

        The snapshot is a copy cut to the prefix's length: later in-place decode steps on
        `cache` cannot touch it, and it costs only what the prefix needs."""
        ids = tuple(int(i) for i in ids)
        have = int(np.asarray(cache.lengths)[row])
        if have != len(ids):
            raise ValueError(f"cache row {row} holds {have} tokens, not the {len(ids)} of this prefix")
        snap = select_rows(cache, [row])
        if snap.max_len is not None:
            snap = resize(snap, len(ids))
        self._entries[ids] = (jnp.array(jnp.asarray(logits)[row:row + 1], copy=True), copy_cache(snap))
        self._entries.move_to_end(ids)
        while len(self._entries) > self.max_entries:
            self._entries.popitem(last=False)

    def lookup(self, ids):
        """(n, entry): the longest saved prefix of `ids` and its (logits, cache), or (0, None)."""
        ids = tuple(int(i) for i in ids)
        best = max((k for k in self._entries if len(k) <= len(ids) and ids[:len(k)] == k), key=len, default=None)
        if best is None:
            return 0, None
        self._entries.move_to_end(best)
        return len(best), self._entries[best]

    def prefill(self, cfg: ModelConfig, params, ids, *, max_len: int):
        """Prefill one prompt, reusing the longest saved prefix; saves the prompt itself.
        Returns (logits [1, V], cache with room for max_len tokens)."""
        from k3jax.infer.generate import extend, prefill
        ids = [int(i) for i in ids]
        n, entry = self.lookup(ids)
        if entry is None:
            logits, cache = prefill(cfg, params, np.array([ids], np.int32), max_len=max_len)
        else:
            logits, snap = entry
            cache = copy_cache(resize(snap, max_len) if snap.max_len is not None else snap)
            if n < len(ids):
                logits, cache = extend(cfg, params, cache, np.array([ids[n:]], np.int32))
        if n < len(ids):
            self.save(ids, cache, logits)
        return logits, cache
