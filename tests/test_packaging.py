"""The built wheel is a package like any other (issue 24): it carries every preset, mesh
preset and sample corpus, ships py.typed, and a non-editable install finds the presets
from any working directory."""
import json
import os
import subprocess
import sys
import zipfile

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def wheel(tmp_path_factory):
    out = tmp_path_factory.mktemp("wheel")
    p = subprocess.run([sys.executable, "-m", "pip", "wheel", ROOT, "--no-deps", "--no-build-isolation",
                        "-q", "-w", str(out)], capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr[-2000:]
    (whl,) = out.glob("k3jax-*.whl")
    return whl


def _files(folder, *suffixes):
    return {f for f in os.listdir(os.path.join(ROOT, folder)) if f.endswith(suffixes)}


def test_wheel_holds_every_preset_and_sample(wheel):
    names = set(zipfile.ZipFile(wheel).namelist())
    want = ({f"k3jax/presets/{f}" for f in _files("configs", ".yaml")}
            | {f"k3jax/presets/meshes/{f}" for f in _files("configs/meshes", ".yaml")}
            | {f"k3jax/presets/meshes/rules/{f}" for f in _files("configs/meshes/rules", ".yaml")}
            | {f"k3jax/data/{f}" for f in _files("data", ".txt", ".jsonl")}
            | {"k3jax/py.typed", "k3jax/k3_special_tokens.json"})
    assert want <= names, sorted(want - names)
    # every module of the source tree is in it
    src = {os.path.relpath(os.path.join(d, f), ROOT) for top in ("k3jax", "pallas_kernels")
           for d, _, fs in os.walk(os.path.join(ROOT, top)) for f in fs if f.endswith(".py")}
    assert src <= names, sorted(src - names)


@pytest.mark.slow
def test_installed_wheel_finds_presets_from_anywhere(wheel, tmp_path):
    site = tmp_path / "site"
    zipfile.ZipFile(wheel).extractall(site)     # what pip install puts in site-packages
    work = tmp_path / "elsewhere"
    work.mkdir()
    env = {**os.environ, "PYTHONPATH": str(site)}

    def cli(*args):
        p = subprocess.run([sys.executable, "-c", "import sys, k3jax, k3jax.cli; print(k3jax.__file__, "
                            "file=sys.stderr); sys.exit(k3jax.cli.main(sys.argv[1:]))", *args],
                           cwd=work, env=env, capture_output=True, text=True, timeout=600)
        assert p.returncode == 0, p.stderr[-2000:]
        assert p.stderr.splitlines()[0].startswith(str(site)), p.stderr[:500]   # the wheel's copy
        return json.loads(p.stdout)

    assert cli("params", "toy", "--json")["total"] > 0
    plan = cli("plan", "k3", "--mesh", "v5p-1024", "--json")
    assert plan["devices"] == 512
    # the toy presets' relative data path resolves to the wheel's corpus
    p = subprocess.run([sys.executable, "-c", "from k3jax.train.loop import _data_path; "
                        "print(_data_path('data/corpus.txt'))"], cwd=work, env=env, capture_output=True,
                       text=True, timeout=300)
    assert p.stdout.strip() == str(site / "k3jax" / "data" / "corpus.txt"), p.stderr[-1000:]
