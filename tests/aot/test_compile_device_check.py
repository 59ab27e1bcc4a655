"""benchmarks/compile/device_check.py --dry-run: the one-command device check runs on this CPU
(Pallas in interpret mode, small shapes) and every check it makes passes, so the run on a
lent device is known to work. The test runs the grouped-matmul and KDA forward sections
(5 s each); the others
(interpret-mode KDA backward, MXFP4 grouped matmul, toy train and decode) take about three
minutes of this CPU: `python benchmarks/compile/device_check.py --dry-run` runs them all."""
import pytest
import importlib.util
import json

from tests.helpers import ROOT


@pytest.mark.slow
def test_device_check_dry_run(tmp_path, monkeypatch):
    scripts = ROOT / "benchmarks" / "compile"
    monkeypatch.syspath_prepend(str(scripts))     # its helper, common.py, as when run as a script
    spec = importlib.util.spec_from_file_location("device_check", scripts / "device_check.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    kernels = ["gmm", "kda_forward"]
    rc = mod.main(["--dry-run", "--out", str(tmp_path), "--budget-s", "100000", "--sections", *kernels])
    result = json.loads((tmp_path / "device_check.json").read_text())
    sections = result["sections"]
    assert rc == 0 and result["failed"] == [], {k: v.get("error") for k, v in sections.items()}
    assert set(sections) == set(kernels) and set(kernels) < set(mod.SECTIONS)
    for name, r in sections.items():
        assert r.get("ok") is True or "skipped" in r, (name, r)
    # the kernels were checked against the pure-JAX paths and the recurrent oracle
    kf = sections["kda_forward"]
    assert max(kf["pallas_vs_chunk"].values()) <= mod.TOL
    assert max(v for d in kf["vs_recurrent_first_tokens"].values() for v in d.values()) <= mod.TOL
    assert set(kf["ms"]) == {"pallas", "chunk"} and kf["anchors_ms"]["goal fwd, H200"] == 3.3
    # the grouped-matmul kernels' values and gradients against the float64 oracle, an empty
    # expert's weight gradient exactly zero
    g = sections["gmm"]
    assert max(g["fp32_vs_float64"].values()) <= 1e-5 and g["empty_experts_dw_max_abs"] == 0.0
    assert g["check_shape"]["empty_experts"] and g["check_shape"]["rows_past_sum"] > 0
