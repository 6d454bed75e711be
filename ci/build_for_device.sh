#!/usr/bin/env bash
# Build the package here (no GPU needed) into .gpu/site, for a GPU machine without the CuTe
# DSL: copy the tree with .gpu/ there and run bash ci/gpu_tests.sh.
set -euo pipefail
cd "$(dirname "$0")/.."
rm -rf .gpu/site
pip install -q --no-deps --no-build-isolation --target .gpu/site .
# (The library's manifest names the commit it was built from: reports on the GPU machine
# take it from there, not from that machine's copy of .git.)
du -sh .gpu/site
# The matrix and the sm_90 wgmma check (nvdisasm is on this machine, not in the CI venv).
python ci/compile_matrix.py .gpu/site/sparseforge/libsparseforge_kernels.so
