"""sparseforge.sdsa on the GPU against the PyTorch reference: the NVFP4 quantizer byte for
byte (scale range, saturation, zero / NaN / midpoint groups, skipped slots and rows, the
cache and its scales as views of one allocation), no rows at all, CUDA-graph replay."""

import pytest
import torch
from sparseforge import sdsa
from sparseforge.check import sdsa_quantize_inputs, sdsa_quantized

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("keys, queries", [(3000, 300), (1, 0), (0, 5)])
def test_quantizer_matches_the_reference_byte_for_byte(dtype, keys, queries):
    args = sdsa_quantize_inputs(dtype, max(keys, 1), max(queries, 1), 64, 512, device="cuda")
    args["key"], args["slots"] = args["key"][:keys], args["slots"][:keys]
    args["query"], args["query_rows"] = args["query"][:queries], args["query_rows"][:queries]
    want = sdsa_quantized(args)
    sdsa.quantize_write_index_qk_nvfp4(**args)
    torch.cuda.synchronize()
    for name, expected in want.items():
        assert torch.equal(args[name], expected), name


def test_graph_replay_writes_what_eager_writes():
    args = sdsa_quantize_inputs(torch.bfloat16, 500, 50, 16, 64, seed=2, device="cuda")
    want = sdsa_quantized(args)
    poisoned = {name: args[name].clone() for name in want}
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        sdsa.quantize_write_index_qk_nvfp4(**args)  # warm-up (loads the kernel)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        sdsa.quantize_write_index_qk_nvfp4(**args)
    for name in want:
        args[name].copy_(poisoned[name])
    graph.replay()
    torch.cuda.synchronize()
    for name, expected in want.items():
        assert torch.equal(args[name], expected), name
