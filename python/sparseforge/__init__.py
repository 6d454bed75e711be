"""sparseforge: block-sparse attention kernels, call-compatible with `flashinfer.sparse`.

Importing needs no GPU and no driver; kernels load on first use. See README.md.
"""

# selftest: the first-use self-checks of variants of archs our GPU suite has not run, put in
# place for every variant choice (families.self_check) by importing it.
from sparseforge import selftest  # noqa: F401
from sparseforge.errors import (
    KernelLaunchError,
    NoGPUError,
    NotBuiltError,
    SparseforgeError,
    UnsupportedArchError,
    VariantNotBuiltError,
    VariantSelfCheckError,
)
from sparseforge.msa_ops import (
    MSASparseAttentionWorkspace,
    msa_decode_nvfp4_specialized_stats,
    msa_prefill_nvfp4_specialized_stats,
    msa_proxy_score,
    msa_proxy_score_fp4,
    msa_sparse_attention,
    msa_sparse_decode_attention,
    msa_topk_select,
    prepare_msa_nvfp4_sparse_decode,
    quantize_write_kv_nvfp4,
    supports_packed_kv,
)
from sparseforge.sage import (
    SageFP8Tensors,
    quantize_bandwidth,
    sage_fp8_quantize,
    sage_fp8_quantize_sm90,
)
from sparseforge.sdsa import quantize_write_index_qk_nvfp4
from sparseforge.sparse import (
    BlockSparseAttentionWrapper,
    CakeVSAPlan,
    VariableBlockSparseAttentionWrapper,
    plan_cake_vsa,
    run_cake_vsa,
)
from sparseforge.token_sparse import group_union_masks, token_sparse_kv_indices
from sparseforge.vsa import video_sparse_attention

__version__ = "0.1.0"

__all__ = [
    "BlockSparseAttentionWrapper",
    "VariableBlockSparseAttentionWrapper",
    "CakeVSAPlan",
    "plan_cake_vsa",
    "run_cake_vsa",
    "SageFP8Tensors",
    "quantize_bandwidth",
    "sage_fp8_quantize",
    "sage_fp8_quantize_sm90",
    "video_sparse_attention",
    "token_sparse_kv_indices",
    "msa_proxy_score",
    "msa_proxy_score_fp4",
    "msa_topk_select",
    "quantize_write_kv_nvfp4",
    "msa_sparse_attention",
    "msa_sparse_decode_attention",
    "prepare_msa_nvfp4_sparse_decode",
    "MSASparseAttentionWorkspace",
    "supports_packed_kv",
    "msa_prefill_nvfp4_specialized_stats",
    "msa_decode_nvfp4_specialized_stats",
    "group_union_masks",
    "quantize_write_index_qk_nvfp4",
    "KernelLaunchError",
    "NoGPUError",
    "NotBuiltError",
    "SparseforgeError",
    "UnsupportedArchError",
    "VariantNotBuiltError",
    "VariantSelfCheckError",
    "__version__",
]
