"""One small block-sparse case per run, for compute-sanitizer on the device:

    compute-sanitizer --tool racecheck python3 ci/sanitize_case.py sparseforge   # or warp_mma

(GQA 2, S=300: ragged rows, an empty row, a short last tile). Prints the relative error.
"""

import sys

import torch

sys.path.insert(0, "tests")
from sparseforge import reference  # noqa: E402
from test_gpu_block_sparse import ragged_mask, random_inputs, reference_for, rel_l2, run_variable  # noqa: E402


def main(backend: str) -> None:
    torch.manual_seed(0)
    hkv, group, seq = 1, 2, 300
    blocks = -(-seq // 64)
    mask = ragged_mask(hkv, blocks, blocks, 3)
    sizes = reference.uniform_sizes(seq, 64).expand(hkv, -1)
    q, k, v = random_inputs(hkv * group, hkv, seq, seq, 128, torch.bfloat16)
    wrapper, out, _ = run_variable(mask, sizes, sizes, q, k, v, backend)
    torch.cuda.synchronize()
    want, _ = reference_for(mask, sizes, sizes, q, k, v)
    print(backend, wrapper.backend_in_use, "relative L2 error", rel_l2(out, want))


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "sparseforge")
