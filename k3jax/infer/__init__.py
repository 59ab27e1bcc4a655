"""Inference: hybrid caches (KDA state + conv tails, MLA latent KV), prefill and cached
decode, sampling, prefix reuse, and the generation loop behind `k3jax generate`
(`k3jax.infer.generate.generate`; the module name is kept free of a same-named export)."""
from k3jax.infer.caches import Cache, cache_bytes, init_cache
from k3jax.infer.generate import decode, extend, prefill
from k3jax.infer.generator import Generator
from k3jax.infer.prefix import PrefixCache
from k3jax.infer.sampling import SamplingParams, sample

__all__ = ["Cache", "cache_bytes", "init_cache", "Generator", "decode", "extend", "prefill",
           "PrefixCache", "SamplingParams", "sample"]
