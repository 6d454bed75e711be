"""msa_attention_combine: the splits of an MSA attention tile merged into the output.

When a launch has few tiles for the GPU's SMs (small-batch decode), each tile's 64-key tiles
are split across CTAs (msa_sparse_attention's `splits`); each writes its rows' normalized O
and lse in fp32. Here one warp per (token, head) row, four channels a lane, merges them:
    lse = log sum_s exp(lse_s)          O = sum_s exp(lse_s - lse) O_s
(the temperature lse alike). A split that saw no key (lse_s = -inf) adds nothing; a row no
split saw gets O = 0 and lse = -inf.
"""

import cutlass
import cutlass.cute as cute

from generator.kernels.common.entry import element_type
from generator.kernels.common.softmax import LN_2, LOG2_E, saturated
from generator.kernels.common.warp_rows import launch_warp_rows, warp_row

NEG_INF = -cutlass.Float32.inf


class MsaAttentionCombine:
    def __init__(self, dtype):
        self.dtype = dtype

    @cute.jit
    def launch(self, args, stream):
        launch_warp_rows(self.kernel(args), args.mO.shape[0] * args.mO.shape[1], stream)

    @cute.kernel
    def kernel(self, args):
        row, lane, _ = warp_row()
        heads = args.mO.shape[1]
        if row < args.mO.shape[0] * heads:
            token = row // heads
            head = row - token * heads
            splits = args.mOSplit.shape[0]
            channels = args.mO.shape[2] // 32  # this lane's: [lane * channels, + channels)
            top = cute.make_rmem_tensor((2,), cutlass.Float32)  # lse, temperature lse
            top.fill(NEG_INF)
            for s in cutlass.range(splits, unroll=1):
                for x in cutlass.range_constexpr(2):
                    top[x] = cute.arch.fmax(top[x], args.mLSESplit[s, x, token, head])
            total = cute.make_rmem_tensor((2,), cutlass.Float32)
            total.fill(0.0)
            acc = cute.make_rmem_tensor((channels,), cutlass.Float32)
            acc.fill(0.0)
            for s in cutlass.range(splits, unroll=1):
                for x in cutlass.range_constexpr(2):
                    lse = args.mLSESplit[s, x, token, head]
                    if lse > NEG_INF:
                        weight = cute.math.exp2((lse - top[x]) * LOG2_E, fastmath=True)
                        total[x] = total[x] + weight
                        if cutlass.const_expr(x == 0):
                            part = args.mOSplit[s, token, head, None]
                            values = cute.local_tile(part, (channels,), (lane,)).load()
                            acc.store(acc.load() + values * weight)
            out = cute.make_rmem_tensor((channels,), self.dtype)
            result = acc.load()
            if total[0] > 0.0:
                result = result / total[0]
            out.store(saturated(result, self.dtype).to(self.dtype))
            dst = args.mO[token, head, None]
            cute.local_tile(dst, (channels,), (lane,)).store(out.load())
            if (args.want_lse != 0) & (lane == 0):
                for x in cutlass.range_constexpr(2):
                    lse = cutlass.Float32(NEG_INF)
                    if total[x] > 0.0:
                        lse = top[x] + cute.math.log2(total[x], fastmath=True) * LN_2
                    if cutlass.const_expr(x == 0):
                        args.mLSE[token, head] = lse
                    else:
                        args.mLSET[token, head] = lse


def make_kernel(variant):
    return MsaAttentionCombine(element_type(variant.params["dtype"]))
