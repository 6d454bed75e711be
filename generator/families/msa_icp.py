"""The MiniMax-M3 index-context-parallel (ICP) indexer's per-rank kernels: the scores of a
rank's shard of the index keys (max of the raw q.k per block), their local top-16 into
carrier rows, and the owner's merge of every rank's rows (sparseforge.msa_icp has the
contract; sparseforge.reference_icp the PyTorch reference).

The scorer sees a rank's shard as pages of R = page_size / world_size key rows, local row i
of page c holding the key at position page_size * c + key_base + i * key_step (P128: base r,
step W, the rows interleaved over the ranks; P256: base r * R, step 1, a contiguous part of
the page), and the queries as rows, row 4 t + h for token t and head h (q [T, 4, 128] as it
lies in memory). Row (4 t + h) of its output holds the token's maxima, page c in column
c * column_scale + column_offset.

A carrier row is 33 int32 words: 16 score words (the raw fp32 bits), 16 global block ids
ascending ((-inf, -1) padding) and a ready flag. The select writes row (t, h) to the local
carrier mCarrier[h, t] (prefill), or publishes it (decode) where an address says: `mBases`
holds the base address of every rank's receive rows (peer-visible pointers), and the row
lies at

    mBases[h // heads_per_owner] + (row_offset + (h % heads_per_owner) * head_rows + t) * row

with row = 33 words, or 32 int64 words (generation << 32 | word) for tagged rows.

Ranking (every selection): a candidate is a block id in [0, min(nvp, 8192)) with a score
above -inf (NaN counts as -inf); the forced ones (ids < force_begin or >= nvp - force_end)
rank first, the rest by score descending, exact ties to the lower id; -0 equals +0.

The fused paths (no score rows): msa_icp_list_score is the scorer keeping each query row's
top-16 of the pages it scores as it goes (one list per split of the row tile's pages, S <=
4), and msa_icp_list_merge ranks a row's S lists (at most 64 candidates, ids distinct: the
splits' pages are) into the row the select would have written. The global top-16 is among
the lists' union: a list holds the best 16 of its pages by the same total order.
"""

from generator.abi import ScalarArg, TensorArg
from generator.family import ALL_ARCHS, Family, Template

TOPK = 16
HEADS = 4  # index heads (version 1 of the contract)
MAX_BLOCKS = 8192  # candidates are blocks below min(nvp, MAX_BLOCKS)
MAX_COLUMNS = 12288  # score columns a select row takes (it keeps a row in shared memory)
CARRIER_WORDS = 2 * TOPK + 1
LIST_WORDS = 2 * TOPK  # a list of the fused paths: 16 score words, 16 ids
MAX_LIST_SPLITS = 4  # lists a row's candidates come in (the list merge's 64 a warp)
TAGGED_WORDS = 2 * TOPK
MAX_WORLD = 4
# Where a row goes (the select's `mode`) and how the merge reads rows (its `mode`).
LOCAL, PUBLISH, PUBLISH_TAGGED = 0, 1, 2  # select: local carrier / legacy / tagged publish
READ, WAIT, WAIT_TAGGED = 0, 1, 2  # merge: prefill carriers / legacy / tagged receive rows
CONSTANTS = {
    "modes": {
        "local": LOCAL,
        "publish": PUBLISH,
        "publish_tagged": PUBLISH_TAGGED,
        "read": READ,
        "wait": WAIT,
        "wait_tagged": WAIT_TAGGED,
    },
    "topk": TOPK,
    "heads": HEADS,
    "max_blocks": MAX_BLOCKS,
    "max_columns": MAX_COLUMNS,
    "carrier_words": CARRIER_WORDS,
    "list_words": LIST_WORDS,
    "max_list_splits": MAX_LIST_SPLITS,
    "tagged_words": TAGGED_WORDS,
    "max_world": MAX_WORLD,
}

_VECTOR = dict(shape=(None,), stride=(1,))
HEAD_DIM = 128
SHARD_ROWS = (32, 64, 128)  # R: P128 over 4 / 2 ranks, P256 over 4 / 2


def _shard_inputs(head_dim):
    """The scorers' inputs: the queries, the shard and the sequences."""
    return (
        TensorArg("mQ", "e4m3", shape=(None, 1, head_dim), stride=(None, None, 1), divisibility=16),
        TensorArg(
            "mK", "e4m3", shape=(None, None, head_dim), stride=(None, None, 1), divisibility=16
        ),
        TensorArg("mCuQ", "i32", **_VECTOR),
        TensorArg("mSeqLenK", "i32", **_VECTOR),
        TensorArg("mQOffset", "i32", **_VECTOR),
        TensorArg("mBlockTable", "i32", shape=(None, None), stride=(None, 1)),
    )


def _shard_scalars():
    """The scorers' grid and the shard's layout (abi_score)."""
    return tuple(
        ScalarArg(name, "i32")
        for name in (
            "max_seqlen_q",
            "position_shift",
            "page_size",
            "key_base",
            "key_step",
            "column_scale",
            "column_offset",
        )
    )


def abi_score(head_dim=HEAD_DIM):
    """mQ          (4 T, 1, D) e4m3: the index queries' rows (row 4 t + h)
    mK          (pages, R, D) e4m3: the rank's shard of the index keys
    mCuQ        (B + 1,)  i32: query tokens before each sequence
    mSeqLenK    (B,)      i32: keys of each sequence
    mQOffset    (B,)      i32: position of each sequence's first query token, less
                          position_shift (decode: the sequence's length, shift -dql)
    mBlockTable (B, >= 1) i32: page ids of each sequence
    mOut        (4 T, K)  f32 out: row 4 t + h, page c in column c * scale + offset
    max_seqlen_q          query tokens of the longest sequence (the grid)
    page_size, key_base, key_step   where local row i of page c lies (module docstring)
    column_scale, column_offset     where page c's maxima go
    fill_columns, fill_page_multiple   a query row's columns that no page of it fills are
                          -inf below fill_columns and (multiple > 0) below the sequence's
                          page count rounded up to a multiple of fill_page_multiple
    page_splits           CTAs a row tile's pages are split over (contiguous runs; their
                          columns are disjoint, so nothing is combined)"""
    return (
        *_shard_inputs(head_dim),
        TensorArg("mOut", "f32", shape=(None, None), stride=(None, 1), output=True),
        *_shard_scalars(),
        ScalarArg("fill_columns", "i32"),
        ScalarArg("fill_page_multiple", "i32"),
        ScalarArg("page_splits", "i32"),
    )


def abi_list_score(head_dim=HEAD_DIM):
    """abi_score's inputs and layout, and instead of the score rows:
    mNumValid   (T,)      i32: each token's global block count (nvp)
    mLists      (S, 4, T, 32) i32 out: list s of row (t, h): the row's top-16 among the
                          pages of split s (16 score words, 16 ids, in no order; (-inf, -1)
                          for an empty entry)
    column_scale, column_offset     page c's global block id is c * scale + offset
    force_begin, force_end          forced blocks (as the select's)
    page_splits           S: CTAs a row tile's pages are split over, a list each"""
    return (
        *_shard_inputs(head_dim),
        TensorArg("mNumValid", "i32", **_VECTOR),
        TensorArg(
            "mLists",
            "i32",
            shape=(None, None, None, LIST_WORDS),
            stride=(None, None, None, 1),
            output=True,
        ),
        *_shard_scalars(),
        ScalarArg("force_begin", "i32"),
        ScalarArg("force_end", "i32"),
        ScalarArg("page_splits", "i32"),
    )


def _row_outputs():
    """Where the selections' rows go (generator/kernels/common/icp_rows.py)."""
    return (
        TensorArg(
            "mCarrier",
            "i32",
            shape=(None, None, CARRIER_WORDS),
            stride=(None, CARRIER_WORDS, 1),
            output=True,
        ),
        TensorArg("mBases", "i64", **_VECTOR),
        TensorArg("mErrors", "i32", **_VECTOR, output=True),
        TensorArg("mGenerations", "i32", shape=(None, None), stride=(None, 1), output=True),
    )


def _row_scalars():
    return tuple(
        ScalarArg(name, "i32")
        for name in (
            "force_begin",
            "force_end",
            "heads_per_owner",
            "head_rows",
            "row_offset",
            "mode",
            "spin_limit",
        )
    )


def abi_select(head_dim=None):
    """mScore        (T, H, K)     f32: a rank's block scores, K columns
    mNumValid     (T,)          i32: each token's global block count (nvp)
    mCarrier      (H, >= T, 33) i32 out: LOCAL: the rows (else unused)
    mBases        (W,)          i64: publishing: base addresses of the ranks' receive rows
    mErrors       (>= 1,)       i32: a publish's wait that timed out adds one (then traps)
    mGenerations  (H, >= T)     i32: tagged publish: each row's last generation (+1 a call)
    index_scale, index_offset   column c is global block c * index_scale + index_offset
    force_begin, force_end      forced blocks (force_begin + force_end <= 16)
    heads_per_owner, head_rows, row_offset   where row (t, h) goes (module docstring)
    mode                        LOCAL (mCarrier, flag 1), PUBLISH (wait for the row's flag
                                to be 0, write, then flag 1), PUBLISH_TAGGED
    spin_limit                  polls of a flag before a wait counts as an error"""
    return (
        TensorArg("mScore", "f32", shape=(None, None, None), stride=(None, None, 1)),
        TensorArg("mNumValid", "i32", **_VECTOR),
        *_row_outputs(),
        ScalarArg("index_scale", "i32"),
        ScalarArg("index_offset", "i32"),
        *_row_scalars(),
    )


def abi_list_merge(head_dim=None):
    """mLists      (S, H, T, 32) i32: the list scorer's lists (S <= 4)
    the rest as abi_select's (no index map: the lists hold global ids)"""
    return (
        TensorArg(
            "mLists", "i32", shape=(None, None, None, LIST_WORDS), stride=(None, None, None, 1)
        ),
        TensorArg("mNumValid", "i32", **_VECTOR),
        *_row_outputs(),
        *_row_scalars(),
    )


def abi_merge(head_dim=None):
    """mRows      (W, hpr, cap, words) i32: one slot set of an owner's rows (33-word carrier
               rows; tagged: the int64 words seen as 64 int32)
    mNumValid  (T,)          i32: nvp of each token
    mOut       (T, hpr, 16)  i32 out: the merged top-16, ascending, -1 tail
    mErrors    (>= 1,)       i32: a wait that timed out adds one (then traps)
    mExpected  (hpr, >= T)   i32: tagged: each row's last merged generation (+1 a call)
    init_blocks, local_blocks   forced blocks
    mode       READ (prefill: rows as they are), WAIT (legacy: wait for each flag, then
               clear it), WAIT_TAGGED (wait until every word carries the next generation)
    prefill    1: a token with nvp 0 gets [0, -1, ...] (else all -1)
    spin_limit polls before a wait counts as an error"""
    return (
        TensorArg("mRows", "i32", shape=(None, None, None, None), stride=(None, None, None, 1)),
        TensorArg("mNumValid", "i32", **_VECTOR),
        TensorArg("mOut", "i32", shape=(None, None, TOPK), stride=(None, None, 1), output=True),
        TensorArg("mErrors", "i32", **_VECTOR, output=True),
        TensorArg("mExpected", "i32", shape=(None, None), stride=(None, 1), output=True),
        ScalarArg("init_blocks", "i32"),
        ScalarArg("local_blocks", "i32"),
        ScalarArg("mode", "i32"),
        ScalarArg("prefill", "i32"),
        ScalarArg("spin_limit", "i32"),
    )


def _score_templates():
    """The scorer's templates (msa_icp_score writes score rows, msa_icp_list_score lists)."""
    configs = tuple(dict(dtype="e4m3", head_dim=HEAD_DIM, shard_rows=r) for r in SHARD_ROWS)
    return (
        # FP8 wgmma (Hopper's FP8 accumulator: see msa_proxy_score's ACCUMULATE), the proxy
        # scorer's pipeline over shard pages.
        Template(
            "sm90_wgmma",
            "generator.kernels.sm90.msa_icp_score",
            mma="wgmma",
            archs=("sm_90a",),
            configs=configs,
        ),
        # mma.sync on every arch (m16n8k32 e4m3, fp32 sums; on sm_90a and sm_100f through
        # fp16 MMAs), the portable proxy scorer's loop; built for sm_90a too.
        Template(
            "warp_mma",
            "generator.kernels.portable.msa_icp_score",
            mma="mma.sync",
            archs=ALL_ARCHS,
            configs=configs,
            portable=True,
        ),
    )


FAMILIES = (
    Family(
        name="msa_icp_score",
        doc="ICP indexer: max of the raw q.k per block over a rank's shard of FP8 index keys",
        abi=abi_score,
        dtypes=("e4m3",),
        constants={**CONSTANTS, "shard_rows": SHARD_ROWS},
        templates=_score_templates(),
    ),
    Family(
        name="msa_icp_list_score",
        doc="ICP indexer (fused paths): each query row's top-16 blocks of a rank's shard, "
        "scored as msa_icp_score scores them, without score rows",
        abi=abi_list_score,
        dtypes=("e4m3",),
        constants={**CONSTANTS, "shard_rows": SHARD_ROWS},
        templates=_score_templates(),
    ),
    Family(
        name="msa_icp_select",
        doc="ICP indexer: a rank's top-16 blocks per (token, head) into carrier or receive rows",
        abi=abi_select,
        constants=CONSTANTS,
        templates=(
            Template(
                "icp_select",
                "generator.kernels.portable.msa_icp_select",
                archs=ALL_ARCHS,
                portable=True,
            ),
        ),
    ),
    Family(
        name="msa_icp_list_merge",
        doc="ICP indexer (fused paths): a row's top-16 of its lists into carrier or receive rows",
        abi=abi_list_merge,
        constants=CONSTANTS,
        templates=(
            Template(
                "icp_list_merge",
                "generator.kernels.portable.msa_icp_list_merge",
                archs=ALL_ARCHS,
                portable=True,
            ),
        ),
    ),
    Family(
        name="msa_icp_merge",
        doc="ICP indexer: an owner's exact top-16 from every rank's carrier rows",
        abi=abi_merge,
        constants=CONSTANTS,
        templates=(
            Template(
                "icp_merge",
                "generator.kernels.portable.msa_icp_merge",
                archs=ALL_ARCHS,
                portable=True,
            ),
        ),
    ),
)
