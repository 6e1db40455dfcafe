"""scripts/gpu_check.sh --dry-run: every step of the device check runs here on CPU at
tiny sizes, and the one table and the merged JSON say so. The entry point is
scripts/gpu_check.sh (the team's instructions for a lent GPU name it); the Python of its
steps is in scripts/gpu_check/.

The device itself is lent only to some tasks; this keeps the script from rotting
between loans: a step that breaks (an import, a renamed function, a check that cannot
pass) fails this test, not a scarce device call.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from loader import load_file

ROOT = Path(__file__).resolve().parents[1]
pytest.importorskip("transformers")
pytest.importorskip("triton")

STEPS = ["profile", "tests", "bench", "integrations"]


@pytest.fixture(scope="module")
def dry_run(tmp_path_factory):
    if shutil.which("bash") is None or shutil.which("timeout") is None:
        pytest.skip("the device script needs bash and coreutils' timeout")
    out = tmp_path_factory.mktemp("gpu_check")
    env = {**os.environ, "PYTHON": sys.executable, "SDPA_GPU_RESULTS": str(out),
           "OUT": str(out)}  # fmt: skip
    env.pop("SDPA_GPU_DRY_RUN", None)
    ran = subprocess.run(
        ["bash", str(ROOT / "scripts" / "gpu_check.sh"), "--dry-run"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    return ran, out


def test_every_step_runs_and_passes(dry_run):
    ran, out = dry_run
    assert ran.returncode == 0, ran.stdout[-4000:] + ran.stderr[-2000:]
    merged = json.loads((out / "gpu_check_dry_run.json").read_text())
    assert list(merged["steps"]) == STEPS
    assert all(s["rc"] == 0 for s in merged["steps"].values()), merged["steps"]
    assert merged["all_passed"] is True


def test_the_table_has_every_section(dry_run):
    ran, out = dry_run
    table = ran.stdout[ran.stdout.index("gpu_check DRY RUN") :]
    for section in ("step", "profile", "cuda tests", "forward bf16", "statistics", "integrations"):
        assert f"\n{section} " in table, section
    for what in ("entropy_and_max", "received", "max_logits", "viewer /row", "unet step"):
        assert what in table, what
    # the step logs and the JSON are copied to $OUT, as the device tool brings it back
    assert {p.name for p in out.glob("*.log")} == {f"{s}.log" for s in STEPS}


def test_each_part_wrote_its_numbers(dry_run):
    _, out = dry_run
    merged = json.loads((out / "gpu_check_dry_run.json").read_text())
    assert merged["profile"]["ours_us"] > 0 and merged["profile"]["cprofile_top"]
    assert merged["cuda_tests"]["tests"] > 0 and merged["cuda_tests"]["failed"] == []
    bench = merged["bench"]
    assert len(bench["forward"]) == 4 and all(r["torch_op"] for r in bench["forward"])
    kernels = {r["what"] for r in bench["statistics"]}
    assert {"entropy_and_max", "received", "max_logits", "ours forward"} <= kernels
    assert len(bench["checks"]) == 8 and all(c["ok"] for c in bench["checks"])
    checks = merged["integrations"]["checks"]
    assert {c["check"] for c in checks} == {"bert", "llama", "viewer", "unet"}


def test_unknown_arguments_are_refused():
    ran = subprocess.run(["bash", str(ROOT / "scripts" / "gpu_check.sh"), "--fast"],
                         cwd=ROOT, capture_output=True, text=True, timeout=30)  # fmt: skip
    assert ran.returncode == 2 and "usage: bash scripts/gpu_check.sh" in ran.stderr


def _report(run: Path, capsys) -> tuple[int, str, dict]:
    gpu_report = load_file("scripts/gpu_check/gpu_report.py")
    rc = gpu_report.main([str(run), "--out", str(run / "merged.json")])
    return rc, capsys.readouterr().out, json.loads((run / "merged.json").read_text())


def test_the_report_fails_a_failed_check_a_timeout_and_a_failed_test(tmp_path, capsys):
    """What the steps wrote decides the verdict: one failed integration check, one step
    past its time limit or one failed CUDA test fails the run; a skipped check does not."""
    (tmp_path / "steps.tsv").write_text("profile\t0\t3\nintegrations\t0\t9\n")
    checks = [{"check": "unet", "what": "diffusers UNet step", "ok": None, "detail": "skipped"},
              {"check": "bert", "what": "bert last_hidden_state", "ok": True,
               "ours_err": 0.01, "eager_err": 0.01}]  # fmt: skip
    (tmp_path / "integrations.json").write_text(json.dumps({"checks": checks}))
    rc, out, merged = _report(tmp_path, capsys)
    assert rc == 0 and merged["all_passed"] is True and "skip" in out
    checks[1]["ok"] = False
    (tmp_path / "integrations.json").write_text(json.dumps({"checks": checks}))
    rc, out, merged = _report(tmp_path, capsys)
    assert rc == 1 and merged["all_passed"] is False and "FAIL" in out
    checks[1]["ok"] = True
    (tmp_path / "integrations.json").write_text(json.dumps({"checks": checks}))
    (tmp_path / "steps.tsv").write_text("profile\t0\t3\nbench\t124\t95\n")
    rc, out, _ = _report(tmp_path, capsys)
    assert rc == 1 and "TIMEOUT" in out
    (tmp_path / "steps.tsv").write_text("tests\t1\t50\n")
    (tmp_path / "pytest.xml").write_text(
        '<testsuites><testsuite tests="2" failures="1" errors="0" skipped="0">'
        '<testcase classname="tests.test_cuda" name="test_a"/>'
        '<testcase classname="tests.test_cuda" name="test_b"><failure/></testcase>'
        "</testsuite></testsuites>"
    )
    rc, out, merged = _report(tmp_path, capsys)
    assert rc == 1 and merged["cuda_tests"]["failed"] == ["tests.test_cuda::test_b"]
    assert "1 passed, 0 skipped, 1 failed" in out
