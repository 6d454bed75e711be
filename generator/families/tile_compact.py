"""The planner's row compaction: each row of a tile mask into its list of tile ids."""

from generator.abi import TensorArg
from generator.family import ALL_ARCHS, Family, Template


def abi(head_dim=None):
    """mListed  (Hkv, R, NT)  uint8, 1 where tile t is listed for (kv head, unit)
    mTileIdx (Hkv, R, NT)  int32 out: the listed tile ids of each row, ascending
    mTileCnt (Hkv, R)      int32 out: how many"""
    return (
        TensorArg("mListed", "u8", shape=(None, None, None), stride=(None, None, 1)),
        TensorArg(
            "mTileIdx",
            "i32",
            shape=(None, None, None),
            stride=(None, None, 1),
            narrow_strides=True,
            output=True,
        ),
        TensorArg("mTileCnt", "i32", shape=(None, None), stride=(None, 1), output=True),
    )


FAMILIES = (
    Family(
        name="tile_compact",
        doc="compact each row of a tile mask into its tile ids (plan())",
        abi=abi,
        templates=(
            Template(
                "tile_compact",
                "generator.kernels.portable.tile_compact",
                archs=ALL_ARCHS,
                portable=True,
            ),
        ),
    ),
)
