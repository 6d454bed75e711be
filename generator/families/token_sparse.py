"""Token-sparse attention inputs from key positions (CUDA cores, every arch).

token_sparse_kv_indices: each token's key positions as paged-cache slot lists, for decode
kernels that read one slot per key. group_union_masks: for groups of consecutive tokens,
the union of their keys as slots and each token's bitmask over it, for masked dense
attention. Pages hold PAGE_KEYS keys: key k of a request is at slot
block_table[request, k // PAGE_KEYS] * PAGE_KEYS + k % PAGE_KEYS.
"""

from generator.abi import ScalarArg, TensorArg
from generator.family import ALL_ARCHS, Family, Template

PAGE_KEYS = 64
POSITIONS_MULTIPLE = 512  # K, the positions per token, is a multiple of this
# group_union_masks keeps a bit per key and a 32-bit column base per 32 keys in shared
# memory: 8 bytes per 32 keys, 64 KiB at this many keys (SM120 has 99 KiB per block).
MAX_UNION_KEYS = 262144
MASK_TILE = 128  # mask columns are written in whole tiles of this many (4 words)
CONSTANTS = {
    "page_keys": PAGE_KEYS,
    "positions_multiple": POSITIONS_MULTIPLE,
    "max_union_keys": MAX_UNION_KEYS,
    "mask_tile": MASK_TILE,
}

_VECTOR = dict(shape=(None,), stride=(1,))
_MATRIX = dict(shape=(None, None), stride=(None, 1))


def abi_kv_indices(head_dim=None):
    """mPositions   (T, K)        i32: key positions, -1 for none
    mRequests    (>= T,)       i32: the block-table row of each token
    mBlockTable  (R, B)        i32: page ids
    mBlockTables (>= T rpt, 2, K) i32 out: slots (plane 0: K, plane 1: V), -1 for none
    mSeqLens     (>= T rpt,)   i32 out: the token's count of positions >= 0
    requests_per_token         rpt: rows per token"""
    return (
        TensorArg("mPositions", "i32", **_MATRIX),
        TensorArg("mRequests", "i32", **_VECTOR),
        TensorArg("mBlockTable", "i32", **_MATRIX),
        TensorArg(
            "mBlockTables",
            "i32",
            shape=(None, 2, None),
            stride=(None, None, 1),
            output=True,
        ),
        TensorArg("mSeqLens", "i32", **_VECTOR, output=True),
        ScalarArg("requests_per_token", "i32"),
    )


def abi_group_union(head_dim=None):
    """mPositions   (T, K)   i32: key positions; outside [0, num_keys) ignored
    mQueryRows   (T,)     i32: each token's mask row, -1: none
    mGroupUnions (G,)     i32: each group's union row, -1: none
    mRequests    (G,)     i32: each group's block-table row
    mBlockTable  (R, B)   i32: page ids
    mUnion       (NU, W)  i32 out: the group's distinct keys as slots, ascending by key
    mUnionSizes  (NU,)    i32 out: how many
    mMask        (NM, MW) i32 out: bit j of word w: the token selected union column 32 w + j
    num_keys               keys of the sequence"""
    return (
        TensorArg("mPositions", "i32", **_MATRIX),
        TensorArg("mQueryRows", "i32", **_VECTOR),
        TensorArg("mGroupUnions", "i32", **_VECTOR),
        TensorArg("mRequests", "i32", **_VECTOR),
        TensorArg("mBlockTable", "i32", **_MATRIX),
        TensorArg("mUnion", "i32", **_MATRIX, output=True),
        TensorArg("mUnionSizes", "i32", **_VECTOR, output=True),
        TensorArg("mMask", "i32", **_MATRIX, output=True),
        ScalarArg("num_keys", "i32"),
    )


FAMILIES = (
    Family(
        name="token_sparse_kv_indices",
        doc="token-sparse slot lists from key positions (token_sparse_kv_indices)",
        abi=abi_kv_indices,
        constants=CONSTANTS,
        templates=(
            Template(
                "token_sparse_kv_indices",
                "generator.kernels.portable.token_sparse_kv_indices",
                archs=ALL_ARCHS,
                portable=True,
            ),
        ),
    ),
    Family(
        name="group_union_masks",
        doc="key unions of token groups and each token's bitmask over them (group_union_masks)",
        abi=abi_group_union,
        constants=CONSTANTS,
        templates=(
            Template(
                "group_union_masks",
                "generator.kernels.portable.group_union_masks",
                archs=ALL_ARCHS,
                portable=True,
            ),
        ),
    ),
)
