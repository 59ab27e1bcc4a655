"""A short greedy sample at the end of a run, to see what the model learned (the cached
decoder of k3jax.infer)."""
from __future__ import annotations

from k3jax.infer.generate import generate as cached_generate


def generate(cfg, params, tok, prompt: str, n_new: int) -> str:
    ids = tok.encode(prompt, bos=True)
    out = cached_generate(cfg, params, [ids], n_new, eos_id=tok.eos_id)[0]
    return prompt + tok.decode(out)
