"""The BSR wrapper's direct selections (q2k_indices, q2k_num) as a block mask with their error
bits, in one launch (sparsity.selection_block_mask is the same in torch ops)."""

from generator.abi import ScalarArg, TensorArg
from generator.family import ALL_ARCHS, Family, Template

# Column blocks a row's shared-memory bitmap holds; wider masks are built in torch.
MAX_COLUMNS = 4096


def abi(head_dim=None):
    """mIndices (H, MB, topk)  int32 each row's selected column blocks (any head and row
                             strides)
    mCounts    (H, MB)       int32 how many of a row's entries are used (q2k_num), read when
                             has_counts
    mMask      (H, MB, NB)   uint8 out: 1 where a used entry selects the column
    mErrors    (1,)          int32 in/out: error bits ORed in (the caller zeroes it)
    has_counts               1: mCounts holds q2k_num; 0: every entry is used
    err_range                the bit of a used entry outside [0, NB)
    err_duplicate            the bit of a row selecting a column twice
    err_count                the bit of a count outside [0, topk]"""
    return (
        TensorArg("mIndices", "i32", shape=(None, None, None), stride=(None, None, 1)),
        TensorArg("mCounts", "i32", shape=(None, None), stride=(None, None)),
        TensorArg("mMask", "u8", shape=(None, None, None), stride=(None, None, 1), output=True),
        TensorArg("mErrors", "i32", shape=(1,), stride=(1,), output=True),
        ScalarArg("has_counts", "i32"),
        ScalarArg("err_range", "i32"),
        ScalarArg("err_duplicate", "i32"),
        ScalarArg("err_count", "i32"),
    )


FAMILIES = (
    Family(
        name="selection_mask",
        doc="direct selections (q2k_indices / q2k_num) as a block mask and error bits (plan())",
        abi=abi,
        constants={"max_columns": MAX_COLUMNS},
        templates=(
            Template(
                "selection_mask",
                "generator.kernels.portable.selection_mask",
                archs=ALL_ARCHS,
                portable=True,
            ),
        ),
    ),
)
