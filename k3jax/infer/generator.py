"""`Generator`: the Python API over a loaded model, with an optional prefix cache."""
from __future__ import annotations

from k3jax.config import ModelConfig
from k3jax.infer.generate import generate
from k3jax.infer.prefix import PrefixCache
from k3jax.infer.sampling import SamplingParams


class Generator:
    """The Python API: a loaded model plus an optional prefix cache.

    >>> g = Generator(cfg, params)
    >>> g.generate([[256, 72, 105]], max_new_tokens=8)             # greedy
    >>> g.generate(prompts, 32, SamplingParams(temperature=0.8, top_p=0.9, seed=1))
    """

    def __init__(self, cfg: ModelConfig, params, *, reuse_prefixes: bool = False):
        self.cfg, self.params = cfg, params
        self.prefixes = PrefixCache() if reuse_prefixes else None

    def generate(self, prompts, max_new_tokens: int, sampling: SamplingParams = SamplingParams(), **kw):
        if self.prefixes is not None and len(prompts) > 1:
            return [self.generate([p], max_new_tokens, sampling, **kw)[0] for p in prompts]
        return generate(self.cfg, self.params, prompts, max_new_tokens, sampling,
                        prefix_cache=self.prefixes, **kw)
