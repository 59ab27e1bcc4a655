"""Test session setup: 8 fake CPU devices and fp32 matmuls, fixed before JAX initialises."""
import os
import sys

# tests/ on the path: the test packages below it import `helpers` and `reference` from here
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

os.environ.setdefault("XLA_FLAGS", "")
if "xla_force_host_platform_device_count" not in os.environ["XLA_FLAGS"]:
    os.environ["XLA_FLAGS"] += " --xla_force_host_platform_device_count=8"
from helpers import FAST_COMPILE  # noqa: E402  (no JAX import there)

if "xla_backend_optimization_level" not in os.environ["XLA_FLAGS"]:
    os.environ["XLA_FLAGS"] += " " + FAST_COMPILE
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# One persistent XLA cache for the whole session, fresh each time: the xdist workers and the
# CLI subprocesses the tests start (they inherit the environment) compile each identical
# toy program once. Values are unaffected; only XLA's backend compile is skipped.
if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
    import atexit
    import shutil
    import tempfile
    os.environ["JAX_COMPILATION_CACHE_DIR"] = tempfile.mkdtemp(prefix="k3jax-tests-xla-cache-")
    os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0.2"
    atexit.register(shutil.rmtree, os.environ["JAX_COMPILATION_CACHE_DIR"], True)

import jax  # noqa: E402

jax.config.update("jax_default_matmul_precision", "highest")
