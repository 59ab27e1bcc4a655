"""The top-level namespace (issue 24): a small public API that `import k3jax` gives without
importing JAX, each name the documented function."""
import subprocess
import sys

import k3jax


def test_import_is_cheap_and_names_resolve_on_use():
    code = "import sys, k3jax; print('jax' in sys.modules); k3jax.forward; print('jax' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    assert out == ["False", "True"]


def test_public_names_are_the_documented_functions():
    from k3jax import config, errors, model
    from k3jax.checkpoint import load
    from k3jax.infer import generate
    from k3jax.ops import kda
    assert sorted(k3jax.__all__) == ["K3JaxError", "forward", "generate", "init_params", "kda", "load_config",
                                     "load_model"]
    assert (k3jax.load_config, k3jax.load_model, k3jax.init_params, k3jax.forward, k3jax.generate, k3jax.kda,
            k3jax.K3JaxError) == (config.load, load.load_model_dir, model.init_params, model.forward,
                                  generate.generate, kda.kda, errors.K3JaxError)
    assert k3jax.load_config("toy").num_hidden_layers > 0
    try:
        k3jax.no_such_thing
    except AttributeError as e:
        assert "no_such_thing" in str(e)
    else:
        raise AssertionError("unknown names must raise AttributeError")
