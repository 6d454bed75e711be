"""nvfp4_kv_write: new tokens' K and V quantized into packed NVFP4 pages at their slots.

One thread per (token, kv head, group of 16 channels), for K and then V. The rounding is the
reference's (sparseforge.reference.nvfp4_quantize), step for step in fp32
(generator/kernels/common/nvfp4.py). The 16 codes go to 8 bytes (the even element in the
low nibble), the scale to its byte (V scales at their 4x4-swizzled place). A negative slot
writes nothing.
"""

import cutlass
import cutlass.cute as cute

from generator.families.nvfp4_kv_write import (
    GROUP,
    HEAD_DIM,
    K_DATA,
    K_SCALES,
    PAGE_TOKENS,
    V_DATA,
    V_SCALES,
)
from generator.kernels.common.nvfp4 import quantize_group
from generator.kernels.common.thread_items import launch_thread_items, split_item, thread_item

GROUPS = HEAD_DIM // GROUP


class Nvfp4KvWrite:
    @cute.jit
    def launch(self, args, stream):
        tokens, heads, _ = args.mK.shape
        launch_thread_items(self.kernel(args), tokens * heads * GROUPS, stream)

    @cute.kernel
    def kernel(self, args):
        tokens, heads, _ = args.mK.shape
        group, head, token = split_item(thread_item(), GROUPS, heads)
        if token < tokens:
            slot = args.mSlots[token]
            if slot >= 0:
                page, row = slot // PAGE_TOKENS, slot % PAGE_TOKENS
                data = head * PAGE_TOKENS * 64 + row * 64 + group * 8
                k_scale = heads * K_SCALES + head * PAGE_TOKENS * 8 + row * 8 + group
                # V scales: (row, group) stored at row (row // 4) * 4 + group // 2, column
                # (group % 2) * 4 + row % 4.
                v_row = row // 4 * 4 + group // 2
                v_scale = heads * V_SCALES + head * PAGE_TOKENS * 8 + v_row * 8
                v_scale = v_scale + group % 2 * 4 + row % 4
                self.write_group(
                    args.mK, args.mPages, token, head, group, page, args.k_global_scale,
                    heads * K_DATA + data, k_scale,
                )  # fmt: skip
                self.write_group(
                    args.mV, args.mPages, token, head, group, page, args.v_global_scale,
                    heads * V_DATA + data, v_scale,
                )  # fmt: skip

    @cute.jit
    def write_group(
        self, mX, mPages, token, head, group, page, global_scale, data_byte, scale_byte
    ):
        """Quantize mX[token, head, 16 group : 16 group + 16] and write its 8 code bytes at
        data_byte and its scale at scale_byte of the page."""
        x = cute.make_rmem_tensor((GROUP,), cutlass.Float32)
        for i in cutlass.range_constexpr(GROUP):
            x[i] = mX[token, head, group * GROUP + i].to(cutlass.Float32)

        def write_byte(b, value):
            mPages[page, data_byte + b] = value

        mPages[page, scale_byte] = quantize_group(x, global_scale, write_byte)


def make_kernel(variant):
    return Nvfp4KvWrite()
