"""Sage FP8 block-sparse attention forward: e4m3 q/k/v with fp32 scales, bf16 output.

Same units, tiles and plan as block_sparse_fwd. Scores are (q8 . k8) * q_scale[row] *
k_scale[key // 16] * sm_scale; the output is (P V8) * v_scale[channel].
"""

from generator.abi import TensorArg
from generator.families.block_sparse_fwd import (
    TILE_KEYS,
    UNIT_ROWS,
    plan_args,
    tcgen05_configs,
)
from generator.families.sage_quantize import KEYS_PER_SCALE
from generator.family import ALL_ARCHS, Family, Template

DTYPES = ("e4m3",)
HEAD_DIMS = (64, 128)


def abi(head_dim: int):
    """mQ         (Sq, Hq, D)    e4m3, unit stride on D
      mK         (Sk, Hkv, D)   e4m3, unit stride on D
      mVt        (D, Sk, Hkv)   e4m3, unit stride on the keys (V transposed: the K-major
                                B operand of P V that e4m3 MMAs need)
      mO         (Sq, Hq, D)    bf16
      mLSE       (Sq, Hq)       fp32, natural log
      mQScale    (Sq, Hq)       fp32 per query token
      mKScale    (4 NT, Hkv)    fp32 per 16 keys, four per 64-key tile (NT = ceil(Sk / 64)):
                                one 16-byte load per tile; plan() pads past the last group
                                with its scale
      mVScale    (D, Hkv)       fp32 per channel
    then block_sparse_fwd.plan_args(). The leading five are per run(); the scales and the
    plan are bound by plan()."""
    fp8 = dict(divisibility=16)
    return (
        TensorArg("mQ", "input", shape=(None, None, head_dim), stride=(None, None, 1), **fp8),
        TensorArg("mK", "input", shape=(None, None, head_dim), stride=(None, None, 1), **fp8),
        TensorArg("mVt", "input", shape=(head_dim, None, None), stride=(None, 1, None), **fp8),
        TensorArg(
            "mO",
            "bf16",
            shape=(None, None, head_dim),
            stride=(None, None, 1),
            divisibility=8,
            output=True,
        ),
        TensorArg("mLSE", "f32", shape=(None, None), stride=(None, None), output=True),
        TensorArg("mQScale", "f32", shape=(None, None), stride=(None, None)),
        TensorArg(
            "mKScale",
            "f32",
            shape=(None, None),
            stride=(1, None),
            divisibility=4,
            narrow_strides=True,
        ),
        TensorArg("mVScale", "f32", shape=(head_dim, None), stride=(None, None)),
        *plan_args(),
    )


FAMILIES = (
    Family(
        name="sage_fp8_fwd",
        doc="Sage FP8 block-sparse attention forward, e4m3 in, bf16 out",
        abi=abi,
        dtypes=DTYPES,
        constants={
            "unit_rows": UNIT_ROWS,
            "tile_keys": TILE_KEYS,
            "keys_per_scale": KEYS_PER_SCALE,
        },
        units_per_cta_key="warpgroups",
        templates=(
            Template(
                "sm90_sage_fp8",
                "generator.kernels.sm90.sage_fp8_fwd",
                mma="wgmma",
                archs=("sm_90a",),
                # One unit a CTA: the kernel is bound by instruction issue, and warpgroups
                # sharing a ring (GQA) run their softmax in step; F3 1.06-1.07x cuDNN against
                # 0.98-0.99 at four a CTA and 1.01 at two
                # (bench/results/2026-12-04_1701517_h200_gqa_units_per_cta.md).
                configs=tuple(dict(dtype=t, head_dim=d) for t in DTYPES for d in HEAD_DIMS),
                # All heads' keys are TMA-loaded through one view, so each head must start a
                # whole number of 64-key tiles after the one before, with the padding after
                # the last head allocated (generator/kernels/sm90/sage_fp8_fwd.py k_tma_view).
                layouts={"mK": "heads_in_whole_tiles"},
            ),
            # tcgen05 kind::f8f6f4 on SM100 (a 128-row tile of one or two units).
            Template(
                "sm100_tcgen05_fp8",
                "generator.kernels.sm100.sage_fp8_fwd",
                mma="tcgen05",
                archs=("sm_100f",),
                configs=tcgen05_configs(DTYPES, HEAD_DIMS),
            ),
            # e4m3 mma.sync: native QMMA on sm_120f; emulated through fp16 MMAs on sm_90a and
            # sm_100f (built there to run on the H200 / for coverage). TMA-loaded K / V^T ring
            # first; the cp.async template is what a failed first-use self-check gives way to.
            Template(
                "tma_warp_mma_fp8",
                "generator.kernels.sm120.sage_fp8_fwd",
                mma="mma.sync",
                archs=ALL_ARCHS,
                configs=tuple(dict(dtype=t, head_dim=d) for t in DTYPES for d in HEAD_DIMS),
                portable=True,
            ),
            Template(
                "warp_mma_fp8",
                "generator.kernels.portable.sage_fp8_fwd",
                mma="mma.sync",
                archs=ALL_ARCHS,
                configs=tuple(dict(dtype=t, head_dim=d) for t in DTYPES for d in HEAD_DIMS),
                portable=True,
            ),
        ),
    ),
)
