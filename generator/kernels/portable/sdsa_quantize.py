"""sdsa_quantize: SDSA keys into a paged NVFP4 key cache and queries into NVFP4 rows, one
launch (quantize_write_index_qk_nvfp4).

One thread per (row, group of 16 values): the key rows first, then the query rows. The
rounding is generator/kernels/common/nvfp4.py's with global scale 1 (the SDSA encoding has
none): scale e4m3(amax / 6), |x| beyond 2688 saturating to +-6 x 448. A negative slot or
query row writes nothing.
"""

import cutlass
import cutlass.cute as cute

from generator.families.sdsa import KEY_DIM, NVFP4_GROUP, PAGE_KEYS
from generator.kernels.common.nvfp4 import quantize_group
from generator.kernels.common.thread_items import launch_thread_items, thread_item

GROUPS = KEY_DIM // NVFP4_GROUP


class SdsaQuantize:
    @cute.jit
    def launch(self, args, stream):
        rows = args.mKey.shape[0] + args.mQuery.shape[0]
        launch_thread_items(self.kernel(args), rows * GROUPS, stream)

    @cute.kernel
    def kernel(self, args):
        index = thread_item()
        group = index % GROUPS
        row = index // GROUPS
        keys = args.mKey.shape[0]
        x = cute.make_rmem_tensor((NVFP4_GROUP,), cutlass.Float32)
        if row < keys:
            slot = args.mSlots[row]
            if slot >= 0:
                page = cutlass.Int32(slot // PAGE_KEYS)
                in_page = cutlass.Int32(slot % PAGE_KEYS)
                for i in cutlass.range_constexpr(NVFP4_GROUP):
                    x[i] = args.mKey[row, group * NVFP4_GROUP + i].to(cutlass.Float32)

                def write_key_byte(b, value):
                    args.mKeyCache[page, in_page, group * (NVFP4_GROUP // 2) + b] = value

                scale = quantize_group(x, cutlass.Float32(1.0), write_key_byte)
                args.mKeyScales[page, in_page, group] = scale
        elif row < keys + args.mQuery.shape[0]:
            query = row - keys
            dest = args.mQueryRows[query]
            if dest >= 0:
                out_row = cutlass.Int32(dest)
                for i in cutlass.range_constexpr(NVFP4_GROUP):
                    x[i] = args.mQuery[query, group * NVFP4_GROUP + i].to(cutlass.Float32)

                def write_query_byte(b, value):
                    args.mPackedQuery[out_row, group * (NVFP4_GROUP // 2) + b] = value

                scale = quantize_group(x, cutlass.Float32(1.0), write_query_byte)
                args.mQueryScales[out_row, group] = scale


def make_kernel(variant):
    return SdsaQuantize()
