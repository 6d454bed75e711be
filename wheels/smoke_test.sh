#!/usr/bin/env bash
# Install a built wheel, or sparseforge from a simple index, into a fresh virtual environment
# and run `python -m sparseforge info`.
#   bash wheels/smoke_test.sh WHEEL [EXPECTED_ARCHS]      e.g. ... wheelhouse/*+sm90a*.whl sm_90a
#   bash wheels/smoke_test.sh file:///.../index/sm90a/simple sm_90a     (pip install --index-url)
# The venv also sees the calling environment's site-packages (appended to its path) so torch
# is not downloaded again; sparseforge itself must come from the wheel, which is checked.
set -euo pipefail
wheel=$1
expected=${2:-}
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
python3 -m venv "$tmp/venv"
parent_site=$(python3 -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
venv_site=$("$tmp/venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
echo "$parent_site" > "$venv_site/_parent_env.pth"
case "$wheel" in
  file://*|http://*|https://*)
    "$tmp/venv/bin/pip" install -q --force-reinstall --no-deps --index-url "$wheel" sparseforge ;;
  *)
    "$tmp/venv/bin/pip" install -q --force-reinstall --no-deps "$wheel" ;;
esac
"$tmp/venv/bin/python" -c "import torch, cuda.bindings" || { echo "smoke test: torch or cuda-bindings missing"; exit 1; }
cd "$tmp"  # away from the source tree: the import must come from the wheel
out=$("$tmp/venv/bin/python" -m sparseforge info)
echo "$out"
echo "$out" | grep -q "^sparseforge " || { echo "smoke test: no version line"; exit 1; }
echo "$out" | grep -q "$tmp/venv/.*libsparseforge_kernels.so" || { echo "smoke test: library not from the venv"; exit 1; }
if [ -n "$expected" ]; then
  echo "$out" | grep -q "^build archs: $expected$" || { echo "smoke test: expected archs $expected"; exit 1; }
fi
echo "smoke test passed: $wheel"
