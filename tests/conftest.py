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


# The modules of end-to-end runs and compiled train steps, slowest first (measured on 2 cores:
# 60-380 s each). pytest-xdist's worksteal hands each worker half of the collection and, when
# one runs dry, moves the tail of the other's queue to it: with these first, what is left at
# the end is short tests and the two workers finish together, instead of one running a
# minute-long train test alone. Each module keeps its tests together and in order (its
# module-scoped fixtures are made once); a module not named keeps its place after these.
RUN_FIRST = ("test_sharding.py", "ops/test_kda_engine.py", "train/test_lora.py", "train/test_lora_runs.py",
             "train/test_qat_runs.py", "infer/test_infer.py", "train/test_train_loop.py", "train/test_dpo_runs.py",
             "train/test_runs.py", "test_distributed.py", "test_distributed_preemption.py")


def pytest_collection_modifyitems(config, items):
    here = os.path.dirname(os.path.abspath(__file__))
    rank = {os.path.join(here, m): i for i, m in enumerate(RUN_FIRST)}
    items.sort(key=lambda item: rank.get(str(item.path), len(RUN_FIRST)))   # stable: in-module order kept
