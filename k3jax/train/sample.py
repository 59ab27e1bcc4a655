"""A short greedy sample at the end of a run, to see what the model learned.

Uses the cached decoder in `k3jax.infer` when that package is present; otherwise a plain
greedy loop over full forwards of one fixed-length buffer (causal, so the padding after
the cursor never affects the logits that are read, and one compile serves every step).
"""
from __future__ import annotations

import importlib.util

import jax
import jax.numpy as jnp
import numpy as np

from k3jax.model import K3Model, variables_of


def greedy_full_forward(cfg, params, ids: list[int], n_new: int, pad_id: int) -> list[int]:
    T = len(ids) + n_new
    buf = np.full((1, T), pad_id, np.int32)
    buf[0, :len(ids)] = ids
    fwd = jax.jit(lambda p, t: jnp.argmax(K3Model(cfg).apply(variables_of(p), t), -1))
    for pos in range(len(ids), T):
        nxt = np.asarray(fwd(params, jnp.asarray(buf)))[0, pos - 1]
        buf[0, pos] = nxt
    return buf[0, len(ids):].tolist()


def generate(cfg, params, tok, prompt: str, n_new: int) -> str:
    ids = tok.encode(prompt, bos=True)
    if importlib.util.find_spec("k3jax.infer.generate") is not None:
        from k3jax.infer.generate import generate as cached_generate
        out = cached_generate(cfg, params, [ids], n_new, eos_id=tok.eos_id)[0]
    else:
        out = greedy_full_forward(cfg, params, ids, n_new, tok.pad_id)
    return prompt + tok.decode(out)
