"""sparseforge.sdsa's argument checks on the CPU: each refusal names the argument; valid
arguments reach the device check."""

import pytest
import torch
from sparseforge import sdsa


def quantize_args(**change):
    args = dict(
        key=torch.randn(3, 128, dtype=torch.bfloat16),
        slots=torch.tensor([0, 70, -1]),
        query=torch.randn(2, 128, dtype=torch.bfloat16),
        query_rows=torch.tensor([1, -1]),
        key_cache=torch.zeros(2, 64, 64, dtype=torch.uint8),
        key_scales=torch.zeros(2, 64, 8, dtype=torch.float8_e4m3fn),
        packed_query=torch.zeros(4, 64, dtype=torch.uint8),
        query_scales=torch.zeros(4, 8, dtype=torch.uint8),
    )
    return args | change


ONE_ALLOCATION = torch.zeros(2, 64 * 72, dtype=torch.uint8)  # data and scales of a page


@pytest.mark.parametrize(
    "change, words",
    [
        ({}, "needs a CUDA device"),
        (
            {"key_cache": ONE_ALLOCATION[:, : 64 * 64].view(2, 64, 64),
             "key_scales": ONE_ALLOCATION[:, 64 * 64 :].view(2, 64, 8)},
            "needs a CUDA device",
        ),
        ({"key": torch.randn(3, 128)}, "key must be a bf16 or fp16 tensor"),
        ({"key": torch.randn(3, 64, dtype=torch.bfloat16)}, "key must be \\(rows, 128\\)"),
        ({"query": torch.randn(2, 128, dtype=torch.float16)}, "query must have key's dtype"),
        ({"slots": torch.tensor([0, 70, -1], dtype=torch.int32)}, "slots must be a contiguous"),
        ({"query_rows": torch.tensor([1])}, "query_rows must be .* of length 2"),
        ({"key_cache": torch.zeros(2, 64, 32, dtype=torch.uint8)}, "key_cache must be \\(2, 64,"),
        ({"key_scales": torch.zeros(2, 32, 8, dtype=torch.uint8)}, "key_scales must be"),
        ({"packed_query": torch.zeros(4, 64, dtype=torch.int8)}, "packed_query must be a uint8"),
        ({"query_scales": torch.zeros(4, 16, dtype=torch.uint8)[:, ::2]}, "query_scales must be"),
    ],
)  # fmt: skip
def test_quantize_arguments(change, words):
    with pytest.raises(ValueError, match=words):
        sdsa.quantize_write_index_qk_nvfp4(**quantize_args(**change))


def test_outputs_may_not_alias_each_other():
    shared = torch.zeros(4, 64, dtype=torch.uint8)
    with pytest.raises(ValueError, match="overlaps"):
        sdsa.quantize_write_index_qk_nvfp4(
            **quantize_args(packed_query=shared, query_scales=shared[:, :8])
        )
