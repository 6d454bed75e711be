"""compute-sanitizer over every kernel variant of this GPU's arch, on small problems
(`python -m sparseforge.check --small`): memcheck, racecheck and initcheck must report no
error. API-error reports are off: cuda-bindings probes driver entry points with invalid
arguments at cuInit, which memcheck would count."""

import os
import shutil
import subprocess
import sys

import pytest

pytestmark = pytest.mark.gpu

TOOLS = ("memcheck", "racecheck", "initcheck")


def sanitizer() -> str | None:
    home = os.environ.get("CUDA_HOME", "/usr/local/cuda")
    found = shutil.which("compute-sanitizer") or os.path.join(home, "bin", "compute-sanitizer")
    return found if os.path.exists(found) else None


@pytest.mark.skipif(
    os.environ.get("SPARSEFORGE_SANITIZE", "1") == "0", reason="SPARSEFORGE_SANITIZE=0"
)
@pytest.mark.parametrize("tool", TOOLS)
def test_every_variant_is_clean_under_compute_sanitizer(tool):
    exe = sanitizer()
    if exe is None:
        pytest.skip("no compute-sanitizer (CUDA toolkit) on this machine")
    command = [exe, "--tool", tool, "--report-api-errors", "no", "--error-exitcode", "99"]
    command += [sys.executable, "-m", "sparseforge.check", "--small"]
    result = subprocess.run(command, capture_output=True, text=True, timeout=900)
    summary = [line for line in result.stdout.splitlines() if "SUMMARY" in line or "failed" in line]
    print("\n".join(summary))
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-2000:]
    clean = "RACECHECK SUMMARY: 0 hazards" if tool == "racecheck" else "ERROR SUMMARY: 0 errors"
    assert clean in result.stdout, summary
