"""quantize_write_kv_nvfp4 on the GPU against reference.nvfp4_write_slots, byte for byte:
bf16 and fp16, Hkv 1 / 4, slots in random order across pages with negative ones skipped,
values of every scale range (tiny ones with subnormal e4m3 scales, zero groups, values
saturating at 448 * 6 * global, E2M1 midpoints exactly), a NaN group, pages poisoned
before the write (untouched tokens keep their bytes), and a CUDA graph replay."""

import pytest
import torch
from sparseforge.check import nvfp4_write_inputs, nvfp4_written_pages
from sparseforge.msa_ops import quantize_write_kv_nvfp4

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("heads", [1, 4])
def test_matches_the_reference_byte_for_byte(dtype, heads):
    args = nvfp4_write_inputs(dtype, heads, tokens=300, pages=4, seed=heads, device="cuda")
    want = nvfp4_written_pages(args)
    got = quantize_write_kv_nvfp4(**args)
    assert got is args["pages"]
    torch.cuda.synchronize()
    assert torch.equal(got, want)


def test_replays_in_a_cuda_graph():
    args = nvfp4_write_inputs(torch.bfloat16, 2, tokens=40, pages=2, seed=9, device="cuda")
    pages = args["pages"]
    start = pages.clone()
    quantize_write_kv_nvfp4(**args)  # binds before capture
    want = pages.clone()
    pages.copy_(start)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        quantize_write_kv_nvfp4(**args)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(pages, want)
