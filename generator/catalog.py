"""The variant catalog: every kernel the library ships, as data.

A variant is one (template, configuration, arch) triple compiled ahead of time. Adding a
variant is adding a row here; the templates read only the fields of their `Variant`.

Every family has one argument ABI (`FAMILY_ABI`) shared by all its templates and archs, so
the runtime packs arguments the same way whichever variant it picks.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

ALL_ARCHS = ("sm_90a", "sm_100a", "sm_120a")

# Element types by short name; the templates map them to cutlass numeric types.
DTYPES = ("bf16", "fp16")
SAGE_DTYPES = ("e4m3",)  # Sage FP8: e4m3 q/k/v with fp32 scales, bf16 output


@dataclass(frozen=True)
class TensorArg:
    """One tensor argument of a family's C ABI.

    `shape` and `stride` hold an int for a compile-time extent or None for a run-time one.
    `name` is the kernel's parameter name (the exported header names its struct after it).
    `dtype` is a dtype name or "input" for the variant's element type.
    """

    name: str
    dtype: str
    shape: tuple
    stride: tuple
    divisibility: int = 1  # of every run-time stride, in elements
    # The kernel narrows the run-time strides to 32 bits (attention_common.with_narrow_strides:
    # a 64-bit stride costs three IMADs per use in the loops); the ABI still passes 64-bit
    # words, and binding checks the tensor spans fewer than 2^31 elements.
    narrow_strides: bool = False

    @property
    def dynamic_shape_modes(self) -> list[int]:
        return [i for i, s in enumerate(self.shape) if s is None]

    @property
    def dynamic_stride_modes(self) -> list[int]:
        return [i for i, s in enumerate(self.stride) if s is None]


@dataclass(frozen=True)
class ScalarArg:
    name: str
    dtype: str  # "f32" or "i32"


def _abi_block_sparse_fwd(head_dim: int):
    """Arguments of the block-sparse forward kernels (all templates).

    The kernels see 64-row query units and 64-key tiles only; the planner maps any block
    size that is a multiple of 64 onto them (python/sparseforge/planner.py).
      mQ, mO     (Sq, Hq, D)   any row and head stride (NHD or HND views), unit stride on D
      mK, mV     (Sk, Hkv, D)
      mLSE       (Sq, Hq)      fp32, natural log, any strides
      mWork      (U,)          unit ids h * R + r in launch order (longest rows first)
      mTileIdx   (Hkv, R, T)   64-key tile ids of each (kv head, 64-row chunk)
      mTileCnt   (Hkv, R)      valid entries of each mTileIdx row
      mTileLen   (NT,)         valid keys of each 64-key tile (0..64)
    """
    qkv = dict(shape=(None, None, head_dim), stride=(None, None, 1), divisibility=8)
    return (
        TensorArg("mQ", "input", **qkv),
        TensorArg("mK", "input", **qkv),
        TensorArg("mV", "input", **qkv),
        TensorArg("mO", "input", **qkv),
        TensorArg("mLSE", "f32", shape=(None, None), stride=(None, None)),
        TensorArg("mWork", "i32", shape=(None,), stride=(1,)),
        TensorArg("mTileIdx", "i32", shape=(None, None, None), stride=(None, None, 1), narrow_strides=True),
        TensorArg("mTileCnt", "i32", shape=(None, None), stride=(None, 1)),
        TensorArg("mTileLen", "i32", shape=(None,), stride=(1,)),
        ScalarArg("scale_log2", "f32"),
    )


def _abi_sage_fp8_fwd(head_dim: int):
    """Arguments of the Sage FP8 block-sparse forward kernels (all templates).

    Same units and tiles as block_sparse_fwd. Scores are (q8 . k8) * q_scale[row] *
    k_scale[key // 16] * sm_scale; the output is (P V8) * v_scale[channel], in bf16.
      mQ         (Sq, Hq, D)    e4m3, unit stride on D
      mK         (Sk, Hkv, D)   e4m3, unit stride on D; sm90_sage_fp8 also needs the head
                                stride a multiple of 64 key rows, with the last head's padding
                                allocated (it TMA-loads all heads through one view, keys
                                permuted within each 16: generator/kernels/sm90_sage_fp8.py)
      mVt        (D, Sk, Hkv)   e4m3, unit stride on the keys (V transposed: the K-major
                                B operand of P V that e4m3 MMAs need)
      mO         (Sq, Hq, D)    bf16
      mLSE       (Sq, Hq)       fp32, natural log
      mQScale    (Sq, Hq)       fp32 per query token
      mKScale    (4 NT, Hkv)    fp32 per 16 keys, four per 64-key tile (NT = ceil(Sk / 64)):
                                one 16-byte load per tile; plan() pads past the last group
                                with its scale (python/sparseforge/planner.py)
      mVScale    (D, Hkv)       fp32 per channel
      mWork, mTileIdx, mTileCnt, mTileLen, scale_log2 as in block_sparse_fwd.
    The leading five are per run(); the scales and the plan are bound by plan().
    """
    fp8 = dict(divisibility=16)
    return (
        TensorArg("mQ", "input", shape=(None, None, head_dim), stride=(None, None, 1), **fp8),
        TensorArg("mK", "input", shape=(None, None, head_dim), stride=(None, None, 1), **fp8),
        TensorArg("mVt", "input", shape=(head_dim, None, None), stride=(None, 1, None), **fp8),
        TensorArg("mO", "bf16", shape=(None, None, head_dim), stride=(None, None, 1), divisibility=8),
        TensorArg("mLSE", "f32", shape=(None, None), stride=(None, None)),
        TensorArg("mQScale", "f32", shape=(None, None), stride=(None, None)),
        TensorArg("mKScale", "f32", shape=(None, None), stride=(1, None), divisibility=4, narrow_strides=True),
        TensorArg("mVScale", "f32", shape=(head_dim, None), stride=(None, None)),
        TensorArg("mWork", "i32", shape=(None,), stride=(1,)),
        TensorArg("mTileIdx", "i32", shape=(None, None, None), stride=(None, None, 1), narrow_strides=True),
        TensorArg("mTileCnt", "i32", shape=(None, None), stride=(None, 1)),
        TensorArg("mTileLen", "i32", shape=(None,), stride=(1,)),
        ScalarArg("scale_log2", "f32"),
    )


def _abi_tile_compact(head_dim=None):
    """Arguments of the planner's row compaction (one warp per row).

      mListed  (Hkv, R, NT)  uint8, 1 where tile t is listed for (kv head, 64-row unit)
      mTileIdx (Hkv, R, NT)  int32 out: the listed tile ids of each row, ascending
      mTileCnt (Hkv, R)      int32 out: how many
    """
    return (
        TensorArg("mListed", "u8", shape=(None, None, None), stride=(None, None, 1)),
        TensorArg("mTileIdx", "i32", shape=(None, None, None), stride=(None, None, 1), narrow_strides=True),
        TensorArg("mTileCnt", "i32", shape=(None, None), stride=(None, 1)),
    )


def _abi_sage_quantize_stats(head_dim: int):
    """Launch 1 of sparseforge.sage_fp8_quantize (generator/kernels/sage_quantize.py).

    The tokens of each kv head are cut into P = ceil(Sk / chunk_tokens) chunks.
      mQ        (Hq, Sq, D)      bf16/fp16, unit stride on D, strides multiples of 8
      mK, mV    (Hkv, Sk, D)     the same
      mQ8       (Hq, Sq, D)      e4m3 out: q codes
      mQScale   (Hq, Sq)         fp32 out: max |q row| / 448
      mPartial  (Hkv, P, 2, D)   fp32 out: per chunk, the sums of k (0) and max |v| (1)
      chunk_tokens   tokens per chunk, a multiple of 256
      smooth_k       0: k is not smoothed (its sums are skipped)
      scale_steps    scale candidates searched per q row (1: the amax scale; at most 16)
    """
    io = dict(shape=(None, None, head_dim), stride=(None, None, 1))
    partial = dict(shape=(None, None, 2, head_dim), stride=(None, None, head_dim, 1))
    return (
        TensorArg("mQ", "input", **io, divisibility=8),
        TensorArg("mK", "input", **io, divisibility=8),
        TensorArg("mV", "input", **io, divisibility=8),
        TensorArg("mQ8", "e4m3", **io, divisibility=16),
        TensorArg("mQScale", "f32", shape=(None, None), stride=(None, 1)),
        TensorArg("mPartial", "f32", **partial),
        ScalarArg("chunk_tokens", "i32"),
        ScalarArg("smooth_k", "i32"),
        ScalarArg("scale_steps", "i32"),
    )


def _abi_sage_quantize_kv(head_dim: int):
    """Launch 2 of sparseforge.sage_fp8_quantize: two CTAs (k, v) per kv head and chunk.
      mK, mV    (Hkv, Sk, D)      bf16/fp16, unit stride on D, strides multiples of 8
      mPartial  (Hkv, P, 2, D)    fp32: launch 1's chunk statistics
      mK8       (Hkv, Sk, D)      e4m3 out: codes of k - k_mean
      mKScale   (Hkv, G)          fp32 out: per 16 tokens, G = ceil(Sk / 16)
      mVt       (Hkv, D, Sk_pad)  e4m3 out: v codes transposed, zero past Sk (Sk_pad = 16 G)
      mVScale   (Hkv, D)          fp32 out: per channel
      mKMean    (Hkv, D)          fp32 out: mean of k over the tokens (0 unless smooth_k)
      chunk_tokens, smooth_k      as in launch 1
      scale_steps                 scale candidates searched per k group (as q's in launch 1)
    """
    io = dict(shape=(None, None, head_dim), stride=(None, None, 1))
    partial = dict(shape=(None, None, 2, head_dim), stride=(None, None, head_dim, 1))
    per_channel = dict(shape=(None, head_dim), stride=(None, 1))
    return (
        TensorArg("mK", "input", **io, divisibility=8),
        TensorArg("mV", "input", **io, divisibility=8),
        TensorArg("mPartial", "f32", **partial),
        TensorArg("mK8", "e4m3", **io, divisibility=16),
        TensorArg("mKScale", "f32", shape=(None, None), stride=(None, 1)),
        TensorArg("mVt", "e4m3", shape=(None, head_dim, None), stride=(None, None, 1),
                  divisibility=16),
        TensorArg("mVScale", "f32", **per_channel),
        TensorArg("mKMean", "f32", **per_channel),
        ScalarArg("chunk_tokens", "i32"),
        ScalarArg("smooth_k", "i32"),
        ScalarArg("scale_steps", "i32"),
    )


FAMILY_ABI = {
    "block_sparse_fwd": _abi_block_sparse_fwd,
    "sage_fp8_fwd": _abi_sage_fp8_fwd,
    "tile_compact": _abi_tile_compact,
    "sage_quantize_stats": _abi_sage_quantize_stats,
    "sage_quantize_kv": _abi_sage_quantize_kv,
}


@dataclass(frozen=True)
class Variant:
    family: str
    template: str  # module name under generator/kernels
    arch: str
    dtype: str | None = None  # element type of the attention operands
    head_dim: int | None = None
    # Consumer warpgroups per CTA (sm90 attention): each runs one unit, all of one tile list
    # (GQA heads of a kv head, 64-row units of one row block), and all read one K/V ring.
    warpgroups: int = 1

    @property
    def name(self) -> str:
        config = f"{self.dtype}_d{self.head_dim}" if self.dtype else "any"
        if self.warpgroups > 1:
            config += f"_w{self.warpgroups}"
        return f"{self.family}__{self.template}__{config}__{self.arch}"

    @property
    def abi(self):
        return FAMILY_ABI[self.family](self.head_dim)

    def params(self) -> dict:
        d = dataclasses.asdict(self)
        for k in ("family", "template", "arch"):
            d.pop(k)
        return d


# Which templates a family has on which arch. `warp_mma` (mma.sync) is portable: it is the
# SM100/SM120 path for now and is also built for sm_90a so that the code shipped for
# Blackwell runs on our H200.
_TEMPLATES = {
    "block_sparse_fwd": {
        "sm_90a": ("sm90_wgmma", "warp_mma"),
        "sm_100a": ("warp_mma",),
        "sm_120a": ("warp_mma",),
    },
    # e4m3 wgmma on Hopper; the portable e4m3 mma.sync template elsewhere (native QMMA on
    # sm_120a, emulated on sm_90a/sm_100a: built there to be run on the H200 / for coverage).
    "sage_fp8_fwd": {
        "sm_90a": ("sm90_sage_fp8", "warp_mma_fp8"),
        "sm_100a": ("warp_mma_fp8",),
        "sm_120a": ("warp_mma_fp8",),
    },
    # Plain CUDA-core code: the same template on every arch.
    "tile_compact": {arch: ("tile_compact",) for arch in ALL_ARCHS},
    # The two launches of the Sage FP8 quantizer: CUDA-core code, the same on every arch.
    "sage_quantize_stats": {arch: ("sage_quantize",) for arch in ALL_ARCHS},
    "sage_quantize_kv": {arch: ("sage_quantize",) for arch in ALL_ARCHS},
}

# sm90 attention: warpgroups per CTA sharing one K/V ring. A plan runs on the most of them
# that are built and that its groups of units allow (python/sparseforge/sparse.py), so only
# counts that pay are built. Interleaved A/B against 2-CTA clusters that multicast each tile
# (the sharing used before; TFLOPS, H200): W3 587 (4) / 544 (2 x 2) / 520 (cluster), W5 545
# (2) / 518 (cluster), F3 Sage 602 (2) / 578 (4) / 575 (cluster):
# bench/results/2026-11-30_19c5b7a+w4_h200_shared_ring_interleaved_ab.md.
WARPGROUPS = {"sm90_wgmma": (1, 2, 4), "sm90_sage_fp8": (1, 2, 4)}

_CONFIGS = {
    "warp_mma": [dict(dtype=dtype, head_dim=hd) for dtype in DTYPES for hd in (64, 128)],
    "sm90_wgmma": [
        dict(dtype=dtype, head_dim=hd, warpgroups=w)
        for dtype in DTYPES for hd in (64, 128) for w in WARPGROUPS["sm90_wgmma"]
    ],
    "warp_mma_fp8": [dict(dtype=dtype, head_dim=hd) for dtype in SAGE_DTYPES for hd in (64, 128)],
    "sm90_sage_fp8": [
        dict(dtype=dtype, head_dim=hd, warpgroups=w)
        for dtype in SAGE_DTYPES for hd in (64, 128) for w in WARPGROUPS["sm90_sage_fp8"]
    ],
    "tile_compact": [{}],
    "sage_quantize": [dict(dtype=dtype, head_dim=hd) for dtype in DTYPES for hd in (64, 128)],
}


def catalog(archs=ALL_ARCHS) -> list[Variant]:
    """All variants for the given archs, in a stable order."""
    unknown = set(archs) - set(ALL_ARCHS)
    if unknown:
        raise ValueError(f"unknown arch(s) {sorted(unknown)}; known: {list(ALL_ARCHS)}")
    out = []
    for family, by_arch in _TEMPLATES.items():
        for arch in ALL_ARCHS:
            if arch not in archs:
                continue
            for template in by_arch.get(arch, ()):
                for cfg in _CONFIGS[template]:
                    out.append(Variant(family=family, template=template, arch=arch, **cfg))
    return out


def by_name(name: str) -> Variant:
    for v in catalog():
        if v.name == name:
            return v
    raise KeyError(f"no variant named {name!r}")
