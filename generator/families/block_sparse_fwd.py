"""Block-sparse attention forward over 64-row query units and 64-key tiles, bf16 / fp16.

The kernels see only units and tiles; the planner (python/sparseforge/planner.py) maps any
block size that is a multiple of 64 onto them and lists, per (kv head, unit), the tiles the
unit attends to. Both wrappers' 16-bit plans run this family.

block_sparse_fwd_logits is the same kernels with FlashInfer's logit options (plan()'s
causal, per-element masks, logits_soft_cap, ALiBi; generator/kernels/common/logit_options.py)
applied to each tile's scores: separate variants, so that plans without options keep the
plain kernels' registers and schedule.
"""

from generator.abi import ScalarArg, TensorArg
from generator.family import ALL_ARCHS, Family, Template

UNIT_ROWS = 64  # query rows of a unit (mWork ids h * R + r, R = ceil(Sq / 64))
TILE_KEYS = 64  # keys of a tile (mTileIdx ids, mTileLen entries)
DTYPES = ("bf16", "fp16")
HEAD_DIMS = (64, 128, 256)
# sm90: warpgroups per CTA sharing one K/V ring. A plan runs on the most of them that are
# built and that its groups of units allow, so only counts that pay are built. Interleaved
# A/B against 2-CTA clusters that multicast each tile (TFLOPS, H200): W3 587 (4) / 544
# (2 x 2) / 520 (cluster), W5 545 (2) / 518 (cluster):
# bench/results/2026-11-30_19c5b7a+w4_h200_shared_ring_interleaved_ab.md.
WARPGROUPS = (1, 2, 4)
# head_dim 256: one CTA per SM (its O accumulator alone takes 128 registers per thread), so
# four warpgroups (128 registers each) cannot hold it.
WARPGROUPS_D256 = (1, 2)
# tma_warp_mma: units per CTA (config key "warpgroups"), 64 query rows each. Its warps own 32
# rows each up to head_dim 128 (two or four warps), 16 at 256 (four warps: one unit).
TMA_WARP_MMA_UNITS = {64: (1, 2), 128: (1, 2), 256: (1,)}
# sm100_tcgen05: units per CTA (1 or 2: its MMA tile is 128 rows, accumulators in TMEM).
TCGEN05_UNITS = (1, 2)


def tcgen05_configs(dtypes, head_dims) -> tuple[dict, ...]:
    """The config grid of a tcgen05 template (this family's and Sage FP8's)."""
    return tuple(
        dict(dtype=t, head_dim=d, warpgroups=units)
        for t in dtypes
        for d in head_dims
        for units in TCGEN05_UNITS
    )


def plan_args():
    """The plan's tensors and scale, shared by every attention family over units and tiles:
    mWork      (U,)          unit ids h * R + r in launch order (longest rows first)
    mTileIdx   (Hkv, R, T)   tile ids of each (kv head, unit)
    mTileCnt   (Hkv, R)      valid entries of each mTileIdx row
    mTileLen   (NT,)         valid keys of each tile (0..64)
    scale_log2               sm_scale * log2(e)
    """
    return (
        TensorArg("mWork", "i32", shape=(None,), stride=(1,)),
        TensorArg(
            "mTileIdx", "i32", shape=(None, None, None), stride=(None, None, 1), narrow_strides=True
        ),
        TensorArg("mTileCnt", "i32", shape=(None, None), stride=(None, 1)),
        TensorArg("mTileLen", "i32", shape=(None,), stride=(1,)),
        ScalarArg("scale_log2", "f32"),
    )


def abi(head_dim: int):
    """mQ, mO     (Sq, Hq, D)   any row and head stride (NHD or HND views), unit stride on D
      mK, mV     (Sk, Hkv, D)
      mLSE       (Sq, Hq)      fp32, natural log, any strides
    then plan_args(). The leading five are per run(); the rest is bound by plan()."""
    qkv = dict(shape=(None, None, head_dim), stride=(None, None, 1), divisibility=8)
    return (
        TensorArg("mQ", "input", **qkv),
        TensorArg("mK", "input", **qkv),
        TensorArg("mV", "input", **qkv),
        TensorArg("mO", "input", **qkv, output=True),
        TensorArg("mLSE", "f32", shape=(None, None), stride=(None, None), output=True),
        *plan_args(),
    )


def logit_options_args():
    """The logit options' arguments (generator/kernels/common/logit_options.py):
    mMaskBits  (Hkv, T, Sq)  int64 words: bit k % 64 of word [k // 64, q] set where query
                             row q may see key k (a tile's rows are adjacent: a warp's
                             reads coalesce; any head stride: 0 shares one mask)
    mAlibi     (Hq,)         ALiBi slope / sm_scale per query head
    diagonal                 Sk - Sq: query i sits at position i + diagonal
    logit_flags              LOGIT_* bits of the options in use
    cap_in, cap_out          soft cap in raw score units: s -> cap_out * tanh(s * cap_in)
    """
    return (
        TensorArg("mMaskBits", "i64", shape=(None, None, None), stride=(None, None, 1)),
        TensorArg("mAlibi", "f32", shape=(None,), stride=(1,)),
        ScalarArg("diagonal", "i32"),
        ScalarArg("logit_flags", "i32"),
        ScalarArg("cap_in", "f32"),
        ScalarArg("cap_out", "f32"),
    )


def logits_abi(head_dim: int):
    """abi(head_dim), then logit_options_args()."""
    return (*abi(head_dim), *logit_options_args())


LOGIT_CAUSAL = 1
LOGIT_MASK = 2
LOGIT_ALIBI = 4
LOGIT_SOFT_CAP = 8


# The logits variants: "masks" (causal and bit masks only) and "scores" (also the soft
# cap and ALiBi, which change every score). Plans with masks alone, the common case, run
# the smaller kernel.
LOGIT_KINDS = ("masks", "scores")


def templates(logits: bool):
    """The family's templates; with `logits`, every config once per LOGIT_KINDS."""
    kinds = [{"logits": kind} for kind in LOGIT_KINDS] if logits else [{}]
    return (
        Template(
            "sm90_wgmma",
            "generator.kernels.sm90.block_sparse_fwd",
            mma="wgmma",
            archs=("sm_90a",),
            configs=tuple(
                dict(dtype=t, head_dim=d, warpgroups=w, **extra)
                for extra in kinds
                for t in DTYPES
                for d in HEAD_DIMS
                for w in (WARPGROUPS_D256 if d == 256 else WARPGROUPS)
            ),
        ),
        # tcgen05 (SM100's tensor cores, accumulators in tensor memory); then TMA +
        # mma.sync: the SM120 kernel (and SM100's where a tcgen05 variant fails its
        # first-use self-check), built for sm_90a too so that it runs on the H200.
        *(
            ()
            if logits
            else (
                Template(
                    "sm100_tcgen05",
                    "generator.kernels.sm100.block_sparse_fwd",
                    mma="tcgen05",
                    archs=("sm_100f",),
                    configs=tcgen05_configs(DTYPES, HEAD_DIMS),
                ),
                Template(
                    "tma_warp_mma",
                    "generator.kernels.sm120.block_sparse_fwd",
                    mma="mma.sync",
                    archs=ALL_ARCHS,
                    configs=tuple(
                        dict(dtype=t, head_dim=d, warpgroups=units)
                        for t in DTYPES
                        for d in HEAD_DIMS
                        for units in TMA_WARP_MMA_UNITS[d]
                    ),
                    portable=True,
                ),
            )
        ),
        # mma.sync with cp.async: every option (the logits variants), and what a TMA variant
        # that fails its first-use self-check gives way to.
        Template(
            "warp_mma",
            "generator.kernels.portable.block_sparse_fwd",
            mma="mma.sync",
            archs=ALL_ARCHS,
            configs=tuple(
                dict(dtype=t, head_dim=d, **extra)
                for extra in kinds
                for t in DTYPES
                for d in HEAD_DIMS
            ),
            portable=True,
        ),
    )


CONSTANTS = {
    "unit_rows": UNIT_ROWS,
    "tile_keys": TILE_KEYS,
    "logit_causal": LOGIT_CAUSAL,
    "logit_mask": LOGIT_MASK,
    "logit_alibi": LOGIT_ALIBI,
    "logit_soft_cap": LOGIT_SOFT_CAP,
}

FAMILIES = (
    Family(
        name="block_sparse_fwd",
        doc="block-sparse attention forward, bf16 / fp16",
        abi=abi,
        dtypes=DTYPES,
        constants=CONSTANTS,
        units_per_cta_key="warpgroups",
        templates=templates(logits=False),
    ),
    Family(
        name="block_sparse_fwd_logits",
        doc="block-sparse attention forward, bf16 / fp16, with causal / mask / soft cap / ALiBi",
        abi=logits_abi,
        dtypes=DTYPES,
        constants=CONSTANTS,
        units_per_cta_key="warpgroups",
        templates=templates(logits=True),
    ),
)
