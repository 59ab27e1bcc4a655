"""Inference: hybrid caches (KDA state + conv tails, MLA latent KV), prefill and cached
decode, sampling, prefix reuse; the generation front door (`Generator`: text | ids |
messages + images -> stream, the tokenizer rule) behind `k3jax generate`; and the
continuous-batching engine (`Engine`, `Request`) behind `k3jax serve`
(`k3jax.infer.generate.generate` is the plain loop; the module name is kept free of a
same-named export)."""
from k3jax.infer.caches import Cache, cache_bytes, init_cache
from k3jax.infer.engine import Engine, Request
from k3jax.infer.generate import decode, extend, prefill
from k3jax.infer.generator import Generator
from k3jax.infer.prefix import PrefixCache
from k3jax.infer.sampling import SamplingParams, sample

__all__ = ["Cache", "cache_bytes", "init_cache", "Engine", "Generator", "Request", "decode", "extend", "prefill",
           "PrefixCache", "SamplingParams", "sample"]
