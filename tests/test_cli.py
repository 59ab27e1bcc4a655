"""The `k3jax` command as a user runs it."""
import json
import subprocess
import sys

from helpers import REFERENCE_CONFIG, need


def k3jax(*args):
    return subprocess.run([sys.executable, "-m", "k3jax.cli", *args], capture_output=True, text=True, timeout=300)


def test_params_json_on_the_real_config():
    out = k3jax("params", str(need(REFERENCE_CONFIG)), "--json")
    assert out.returncode == 0, out.stderr
    counts = json.loads(out.stdout.strip().splitlines()[-1])
    assert counts["total"] == 2_779_484_478_208 and counts["active"] == 104_189_614_848


def test_params_unknown_config_is_a_clear_error():
    out = k3jax("params", "no_such_model")
    assert out.returncode == 2 and "no_such_model" in out.stderr and "Traceback" not in out.stderr
