#!/usr/bin/env bash
# GPU tests, demo and benchmark on a GPU machine, from the build in .gpu/site (made by
# ci/build_for_device.sh on a machine with the CuTe DSL; this one needs none). Logs go to
# $OUT. Usage: bash ci/gpu_tests.sh [pytest args...]
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/sparseforge-out}
mkdir -p "$OUT"
export PYTHONPATH="$PWD/.gpu/site${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
status=0
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv > "$OUT/gpu.txt" 2>&1
python3 -m sparseforge info 2>&1 | tee "$OUT/info.txt" || status=1
# A deadlocked kernel would hang the run: pytest-timeout (where installed) ends it.
timeout_args=()
python3 -c "import pytest_timeout" 2>/dev/null && timeout_args=(--timeout 300 --timeout-method thread)
# The ICP indexer's kernels wait on flags and trap when a wait times out, which ends the
# process's CUDA context: their tests run in a process of their own.
icp=tests/test_gpu_msa_icp.py
python3 -m pytest "$icp" -q -m gpu -p no:cacheprovider "${timeout_args[@]}" 2>&1 | tail -n 100 > "$OUT/gpu_tests_icp.log"
[ "${PIPESTATUS[0]}" -eq 0 ] || status=1
tail -n 5 "$OUT/gpu_tests_icp.log"
# compute-sanitizer over every variant takes minutes: its own process, last, so that a time
# limit cutting it short leaves the suite's log whole. Logs are written as the tests run.
sanitize=tests/test_gpu_sanitizer.py
python3 -m pytest tests -q -m gpu -p no:cacheprovider --ignore "$icp" --ignore "$sanitize" \
  "${timeout_args[@]}" "$@" > "$OUT/gpu_tests.log" 2>&1 || status=1
tail -n 15 "$OUT/gpu_tests.log"
python3 -m sparseforge demo 2>&1 | tee "$OUT/demo.txt" || status=1
if [ "${SPARSEFORGE_BENCH:-1}" = 1 ]; then
  python3 -m sparseforge.bench --selection --out "$OUT/bench.md" 2>&1 | tee "$OUT/bench.log" || status=1
  python3 -m sparseforge.bench --backend warp_mma --out "$OUT/bench_warp_mma.md" 2>&1 | tail -n 12 || status=1
fi
# SPARSEFORGE_SANITIZE picks the tools (0: none).
python3 -m pytest "$sanitize" -q -s -m gpu -p no:cacheprovider > "$OUT/gpu_sanitizer.log" 2>&1 || status=1
tail -n 8 "$OUT/gpu_sanitizer.log"
exit $status
