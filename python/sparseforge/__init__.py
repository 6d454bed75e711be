"""sparseforge: block-sparse attention kernels, call-compatible with `flashinfer.sparse`.

Importing needs no GPU and no driver; kernels load on first use. See README.md.
"""

from sparseforge.errors import (
    KernelLaunchError,
    NoGPUError,
    NotBuiltError,
    SparseforgeError,
    UnsupportedArchError,
    VariantNotBuiltError,
)
from sparseforge.sage import SageFP8Tensors, quantize_bandwidth, sage_fp8_quantize
from sparseforge.sparse import BlockSparseAttentionWrapper, VariableBlockSparseAttentionWrapper
from sparseforge.vsa import video_sparse_attention

__version__ = "0.1.0"

__all__ = [
    "BlockSparseAttentionWrapper",
    "VariableBlockSparseAttentionWrapper",
    "SageFP8Tensors",
    "quantize_bandwidth",
    "sage_fp8_quantize",
    "video_sparse_attention",
    "KernelLaunchError",
    "NoGPUError",
    "NotBuiltError",
    "SparseforgeError",
    "UnsupportedArchError",
    "VariantNotBuiltError",
    "__version__",
]
