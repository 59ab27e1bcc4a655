"""k3jax: Kimi K3 in pure-functional JAX / Flax.

The public surface, importable from here (each loads its module on first use, so
`import k3jax` stays cheap):

    cfg = k3jax.load_config("toy")                       # a preset, YAML or config.json -> ModelConfig
    params = k3jax.init_params(cfg, jax.random.PRNGKey(0))
    k3, params = k3jax.load_model("path/to/model")       # HF dir, `k3jax convert` output or a run
    logits = k3jax.forward(k3.text, params, tokens)      # [B, T] int32 -> [B, T, V]
    ids = k3jax.generate(k3.text, params, [[...]], max_new_tokens=16)
    o, state = k3jax.kda(q, k, v, g, beta, impl="chunk")  # the KDA engine on its own
"""

__version__ = "0.1.0"

# name -> (module, attribute)
_PUBLIC = {
    "load_config": ("k3jax.config", "load"),
    "load_model": ("k3jax.checkpoint.load", "load_model_dir"),
    "init_params": ("k3jax.model.params", "init_params"),
    "forward": ("k3jax.model.transformer", "forward"),
    "generate": ("k3jax.infer.generate", "generate"),
    "kda": ("k3jax.ops.kda", "kda"),
    "K3JaxError": ("k3jax.errors", "K3JaxError"),
}
__all__ = sorted(_PUBLIC)


def __getattr__(name):
    if name not in _PUBLIC:
        raise AttributeError(f"module 'k3jax' has no attribute {name!r}")
    import importlib
    module, attr = _PUBLIC[name]
    value = getattr(importlib.import_module(module), attr)
    globals()[name] = value
    return value


def __dir__():
    return sorted(list(globals()) + list(_PUBLIC))
