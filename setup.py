"""The wheel carries the repository's top-level configs/ as the package `k3jax.presets`
(pyproject.toml has everything else): a plain `pip install .` finds `k3jax train toy` and
`--mesh v5p-1024` from any working directory, and data/ (the toy corpora) as `k3jax.data`, and the repository keeps configs/ where
users look for them."""
from setuptools import find_packages, setup

PRESETS = {"k3jax.presets": "configs", "k3jax.presets.meshes": "configs/meshes",
           "k3jax.presets.meshes.rules": "configs/meshes/rules"}
SAMPLES = {"k3jax.data": "data"}    # the toy corpora the presets' relative data paths name

setup(packages=find_packages(include=["k3jax*", "pallas_kernels*"]) + list(PRESETS) + list(SAMPLES),
      package_dir={**PRESETS, **SAMPLES},
      package_data={"k3jax": ["py.typed", "k3_special_tokens.json"], **{p: ["*.yaml"] for p in PRESETS},
                    **{p: ["*.txt", "*.jsonl"] for p in SAMPLES}})
