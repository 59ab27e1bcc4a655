"""Next-token sampling: greedy (temperature 0), temperature, top-k, top-p; seeded."""
from __future__ import annotations

import functools
from dataclasses import dataclass

import jax
import jax.numpy as jnp

from k3jax.errors import InputError


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0   # 0: greedy (argmax)
    top_k: int = 0             # 0: no top-k cut
    top_p: float = 1.0         # 1: no nucleus cut
    seed: int = 0

    def __post_init__(self):
        if self.temperature < 0:
            raise InputError(f"temperature must be >= 0, got {self.temperature}")
        if self.top_k < 0:
            raise InputError(f"top_k must be >= 0, got {self.top_k}")
        if not 0.0 < self.top_p <= 1.0:
            raise InputError(f"top_p must lie in (0, 1], got {self.top_p}")


@functools.partial(jax.jit, static_argnames=("temperature", "top_k", "top_p"))
def sample(logits, key, *, temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0):
    """logits [B, V] fp32 → token ids [B] int32.

    Filters apply in the usual order: temperature, then top-k, then top-p over what is
    left (the smallest set of most likely tokens whose probability reaches top_p; the most
    likely token always survives). The settings are static: each combination compiles once.
    """
    logits = logits.astype(jnp.float32)
    if temperature == 0.0:
        return jnp.argmax(logits, axis=-1).astype(jnp.int32)
    logits = logits / temperature
    if 0 < top_k < logits.shape[-1]:
        kth = jax.lax.top_k(logits, top_k)[0][:, -1:]
        logits = jnp.where(logits < kth, -jnp.inf, logits)
    if top_p < 1.0:
        srt = jnp.sort(logits, axis=-1)[:, ::-1]
        probs = jax.nn.softmax(srt, axis=-1)
        before = jnp.cumsum(probs, axis=-1) - probs   # mass strictly above each sorted entry
        keep = before < top_p                          # the first entry always has 0 before it
        cutoff = jnp.min(jnp.where(keep, srt, jnp.inf), axis=-1, keepdims=True)
        logits = jnp.where(logits < cutoff, -jnp.inf, logits)
    return jax.random.categorical(key, logits, axis=-1).astype(jnp.int32)


def step_key(seed: int, step: int):
    """The key for decode step `step`: one stream per seed, independent of batch layout."""
    return jax.random.fold_in(jax.random.PRNGKey(seed), step)


def _sample_row(logits, key, temperature, top_k, top_p):
    # `sample`'s filters with the settings as traced values: one compile serves every mix
    greedy = jnp.argmax(logits).astype(jnp.int32)
    x = logits / jnp.maximum(temperature, 1e-6)
    srt = jnp.sort(x)[::-1]
    kth = jnp.where((top_k > 0) & (top_k < x.shape[0]), srt[jnp.clip(top_k - 1, 0, x.shape[0] - 1)], -jnp.inf)
    x = jnp.where(x < kth, -jnp.inf, x)
    srt = jnp.sort(x)[::-1]
    probs = jax.nn.softmax(srt)
    before = jnp.cumsum(probs) - probs
    cutoff = jnp.min(jnp.where(before < top_p, srt, jnp.inf))
    x = jnp.where((top_p < 1.0) & (x < cutoff), -jnp.inf, x)
    drawn = jax.random.categorical(key, x[None], axis=-1)[0].astype(jnp.int32)
    return jnp.where(temperature == 0.0, greedy, drawn)


def sample_rows(logits, seeds, steps, temperature, top_k, top_p):
    """Each row its own settings (arrays [B]) and stream: row b draws with
    `step_key(seeds[b], steps[b])`, as a batch of one would at that step (the serving
    engine's per-request sampling). logits [B, V] → ids [B] int32; jit it around."""
    keys = jax.vmap(lambda s, t: jax.random.fold_in(jax.random.PRNGKey(s), t))(seeds, steps)
    return jax.vmap(_sample_row)(logits.astype(jnp.float32), keys, temperature, top_k, top_p)
