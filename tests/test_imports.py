"""Imports run one way (README "Layout"): each module imports only from its own floor or
the floors below it, function-level imports included."""
import ast
import os

from helpers import ROOT

FLOORS = ("ground", "kernels", "ops", "layers", "model", "jobs", "command")
GROUND = ("config", "configfiles", "errors", "mesh", "layout", "lora", "textfiles", "tokenizer")


def floor(module: str) -> str | None:
    parts = module.split(".")
    if parts[0] == "pallas_kernels":
        return "kernels"
    if parts[0] != "k3jax":
        return None
    if len(parts) == 1 or parts[1] in ("cli", "commands", "__main__"):
        return "command"        # k3jax/__init__ is the lazy public API over everything
    return {"ops": "ops", "layers": "layers", "model": "model"}.get(
        parts[1], "ground" if parts[1] in GROUND else "jobs")


def imports(path: str):
    for node in ast.walk(ast.parse(open(path).read())):
        if isinstance(node, ast.Import):
            yield from (a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            if node.module != "k3jax":
                yield node.module
            yield from (f"{node.module}.{a.name}" for a in node.names)


def test_no_module_imports_from_a_floor_above_its_own():
    upward, seen = [], 0
    for top in ("k3jax", "pallas_kernels"):
        for d, _, files in os.walk(ROOT / top):
            for f in files:
                if not f.endswith(".py"):
                    continue
                path = os.path.join(d, f)
                module = os.path.relpath(path, ROOT)[:-3].replace(os.sep, ".").removesuffix(".__init__")
                mine = FLOORS.index(floor(module))
                seen += 1
                for target in imports(path):
                    theirs = floor(target)
                    if theirs is not None and FLOORS.index(theirs) > mine:
                        upward.append(f"{module} ({FLOORS[mine]}) imports {target} ({theirs})")
    assert seen > 100 and not upward, upward


def test_the_check_sees_an_upward_import(tmp_path):
    """The rule itself: a layer importing the model is upward, the model importing ops is not."""
    assert FLOORS.index(floor("k3jax.model")) > FLOORS.index(floor("k3jax.layers.moe"))
    assert floor("k3jax.ops.moe_dispatch") == "ops" and floor("k3jax.mesh") == "ground"
    assert floor("k3jax.plan") == "jobs" and floor("pallas_kernels.kda.fwd") == "kernels"
    p = tmp_path / "m.py"
    p.write_text("def f():\n    from k3jax.model import K3Model\n    from k3jax import plan\n")
    assert set(imports(str(p))) == {"k3jax.model", "k3jax.model.K3Model", "k3jax.plan"}


def test_the_package_never_imports_its_test_helpers():
    """k3jax.testing is for tests and benchmarks: no module a user runs depends on it."""
    users = []
    for d, _, files in os.walk(ROOT / "k3jax"):
        for f in files:
            path = os.path.join(d, f)
            if f.endswith(".py") and os.sep + "testing" + os.sep not in path:
                users += [f"{path}: {t}" for t in imports(path) if t.startswith("k3jax.testing")]
    assert not users, users


def test_the_readme_places_every_module_on_its_floor():
    """README's floor table names each top-level module and package of k3jax (and the
    kernels) in the row of the floor this test gives it."""
    import re
    text = (ROOT / "README.md").read_text()
    rows = re.findall(r"^\| (\w+) \| (.*) \|$", text.split("| floor | modules |")[1].split("\n\n")[0], re.M)
    placed = {}
    for name, cell in rows:
        for token in re.findall(r"`([\w/.]+)`", cell):
            if token.endswith((".py", "/")):
                path = token if token.startswith(("k3jax/", "pallas_kernels/")) else "k3jax/" + token
                placed[path.rstrip("/").removesuffix(".py")] = name
    entries = ["pallas_kernels"] + [f"k3jax/{n.removesuffix('.py')}" for n in os.listdir(ROOT / "k3jax")
                                    if (n.endswith(".py") or (ROOT / "k3jax" / n / "__init__.py").exists())
                                    and not n.startswith("_")]
    wrong = {e: placed.get(e) for e in entries if placed.get(e) != floor(e.replace("/", "."))}
    assert len(entries) > 20 and not wrong, wrong
