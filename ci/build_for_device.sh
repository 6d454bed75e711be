#!/usr/bin/env bash
# Build the package here (no GPU needed) into .gpu/site, for a GPU machine without the CuTe
# DSL: copy the tree with .gpu/ there and run bash ci/gpu_tests.sh.
set -euo pipefail
cd "$(dirname "$0")/.."
rm -rf .gpu/site
pip install -q --no-deps --no-build-isolation --target .gpu/site .
# The commit this build is of (-dirty: uncommitted changes), for the GPU machine's reports:
# its copy of the tree may carry a stale .git.
git describe --always --dirty --abbrev=7 > .gpu/commit.txt
du -sh .gpu/site
# The matrix and the sm_90 wgmma check (nvdisasm is on this machine, not in the CI venv).
python ci/compile_matrix.py .gpu/site/sparseforge/libsparseforge_kernels.so
