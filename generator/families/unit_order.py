"""The planner's launch order of the attention kernels' units (longest tile list first) and
the recheck of the block-size tensors plan() read on the host, in one launch."""

from generator.abi import ScalarArg, TensorArg
from generator.family import ALL_ARCHS, Family, Template

# Counts of listed tiles the kernel orders: below this (a shared-memory histogram of this
# many int32); planner.longest_first orders longer lists in torch.
MAX_COUNT = 4096


def abi(head_dim=None):
    """mTileCnt  (Hkv, R)   int32 listed tiles of each (kv head, unit)
    mWork      (E,)       int32 out: unit ids h * R + r in launch order (planner.longest_first)
    mRowSizes  (Hkv, MB)  int32 a block-size tensor as it is now
    mRowRead   (Hkv, MB)  int64 its values when plan() read them
    mColSizes, mColRead   the same for the column sizes (pass a pair twice for one tensor)
    mErrors    (1,)       int32 out: stale_bit if a size tensor changed, else 0
    items_per_head        item heads per kv head (query heads per kv head, / units_per_item
                          when a CTA's units are query heads)
    units_per_item        units per attention CTA
    rows_per_item         1 (a CTA's units are query heads of one row) or units_per_item
                          (consecutive rows of one head)
    stale_bit             the error bit of a changed size tensor"""
    sizes = dict(shape=(None, None), stride=(None, None))
    return (
        TensorArg("mTileCnt", "i32", shape=(None, None), stride=(None, 1)),
        TensorArg("mWork", "i32", shape=(None,), stride=(1,), output=True),
        TensorArg("mRowSizes", "i32", **sizes),
        TensorArg("mRowRead", "i64", **sizes),
        TensorArg("mColSizes", "i32", **sizes),
        TensorArg("mColRead", "i64", **sizes),
        TensorArg("mErrors", "i32", shape=(1,), stride=(1,), output=True),
        ScalarArg("items_per_head", "i32"),
        ScalarArg("units_per_item", "i32"),
        ScalarArg("rows_per_item", "i32"),
        ScalarArg("stale_bit", "i32"),
    )


FAMILIES = (
    Family(
        name="unit_order",
        doc="the units' launch order, longest tile list first, and the block sizes' recheck "
        "(plan())",
        abi=abi,
        constants={"max_count": MAX_COUNT},
        templates=(
            Template(
                "unit_order",
                "generator.kernels.portable.unit_order",
                archs=ALL_ARCHS,
                portable=True,
            ),
        ),
    ),
)
