"""compute-sanitizer over every kernel variant of this GPU's arch, on small problems
(`python -m sparseforge.check --small`): memcheck, initcheck and racecheck must report no
error, in that order (racecheck, much the slowest, last: a run cut short by a time limit has
the other two). API-error reports are off: cuda-bindings probes driver entry points with invalid
arguments at cuInit, which memcheck would count.

Each tool runs as SPARSEFORGE_SANITIZE_SHARDS processes side by side (default: half the CPU
cores, at most 8), each over every N-th variant (`--shard I/N`): a tool's time is its slowest
shard's, not the sum over the variants (with one process a tool, the three had not finished
after 450 s on an H100).

SPARSEFORGE_SANITIZE: "1" (default) runs the three tools, "0" none, or a comma-separated
list of tools (racecheck over every variant takes minutes; e.g. "memcheck,initcheck")."""

import os
import shutil
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

pytestmark = pytest.mark.gpu

TOOLS = ("memcheck", "initcheck", "racecheck")


def sanitizer() -> str | None:
    home = os.environ.get("CUDA_HOME", "/usr/local/cuda")
    found = shutil.which("compute-sanitizer") or os.path.join(home, "bin", "compute-sanitizer")
    return found if os.path.exists(found) else None


def chosen_tools() -> tuple[str, ...]:
    """The tools SPARSEFORGE_SANITIZE asks for."""
    value = os.environ.get("SPARSEFORGE_SANITIZE", "1")
    if value in ("0", "1"):
        return TOOLS if value == "1" else ()
    chosen = tuple(tool.strip() for tool in value.split(","))
    unknown = [tool for tool in chosen if tool not in TOOLS]
    if unknown:
        raise ValueError(f"SPARSEFORGE_SANITIZE names {unknown}: not among {TOOLS}")
    return chosen


@pytest.mark.parametrize("tool", TOOLS)
def test_every_variant_is_clean_under_compute_sanitizer(tool):
    if tool not in chosen_tools():
        pytest.skip(f"SPARSEFORGE_SANITIZE={os.environ.get('SPARSEFORGE_SANITIZE')}")
    exe = sanitizer()
    if exe is None:
        pytest.skip("no compute-sanitizer (CUDA toolkit) on this machine")
    command = [exe, "--tool", tool, "--report-api-errors", "no", "--error-exitcode", "99"]
    command += [sys.executable, "-m", "sparseforge.check", "--small"]
    count = shards()

    def run_shard(i):
        start = time.perf_counter()
        result = subprocess.run(
            command + ["--shard", f"{i}/{count}"], capture_output=True, text=True, timeout=900
        )
        return result, time.perf_counter() - start

    with ThreadPoolExecutor(count) as pool:
        results = list(pool.map(run_shard, range(count)))
    clean = "RACECHECK SUMMARY: 0 hazards" if tool == "racecheck" else "ERROR SUMMARY: 0 errors"
    problems = []
    for i, (result, seconds) in enumerate(results):
        out = result.stdout
        summary = [line for line in out.splitlines() if "SUMMARY" in line or "failed" in line]
        print(f"{tool} shard {i}/{count} ({seconds:.0f} s): " + " | ".join(summary))
        if result.returncode != 0 or clean not in out:
            problems.append(f"shard {i}/{count}: {out[-3000:]}{result.stderr[-2000:]}")
    assert not problems, "\n".join(problems)


def shards() -> int:
    """Sanitizer processes a tool runs side by side: SPARSEFORGE_SANITIZE_SHARDS, else half
    the CPU cores (each process keeps about one busy), at most 8."""
    value = os.environ.get("SPARSEFORGE_SANITIZE_SHARDS")
    if value is not None:
        return max(1, int(value))
    return max(1, min(8, (os.cpu_count() or 2) // 2))
