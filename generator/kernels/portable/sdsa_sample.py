"""sdsa_sample: rows of sampled keys for the SDSA thresholds (gather_key_sample).

One thread per (sample row, slot, 16 bytes of the key): slot s < mSampleEnds[r] copies
logical key (s // samples_per_run) * 64 * pages_per_run + offsets[s] of table row r (its
page mBlockTable[r, key // 64], row key % 64); with NVFP4 keys the first 16 bytes' thread
also copies the key's 8 scale bytes. Other slots are untouched.
"""

import cutlass
import cutlass.cute as cute

from generator.families.sdsa import PAGE_KEYS
from generator.kernels.common.entry import element_type
from generator.kernels.common.thread_items import launch_thread_items, split_item, thread_item

CHUNK_BYTES = 16


class SdsaSample:
    def __init__(self, dtype, nvfp4: bool):
        self.dtype = dtype
        self.nvfp4 = nvfp4
        self.per_chunk = CHUNK_BYTES * 8 // dtype.width  # elements of 16 bytes
        self.chunks = (64 if nvfp4 else 256) // CHUNK_BYTES  # 16-byte pieces of a key row

    @cute.jit
    def launch(self, args, stream):
        rows, cap, _ = args.mSampleKeys.shape
        launch_thread_items(self.kernel(args), rows * cap * self.chunks, stream)

    @cute.kernel
    def kernel(self, args):
        rows, cap, _ = args.mSampleKeys.shape
        chunk, slot, row = split_item(thread_item(), self.chunks, cap)
        if row < rows:
            if slot < args.mSampleEnds[row]:
                run = slot // args.samples_per_run
                key = run * PAGE_KEYS * args.pages_per_run + cutlass.Int32(args.mOffsets[slot])
                page = args.mBlockTable[row, key // PAGE_KEYS]
                src = args.mKeyCache[page, key % PAGE_KEYS, None]
                dst = args.mSampleKeys[row, slot, None]
                piece = cute.local_tile(src, (self.per_chunk,), (chunk,)).load()
                cute.local_tile(dst, (self.per_chunk,), (chunk,)).store(piece)
                if cutlass.const_expr(self.nvfp4):
                    if chunk == 0:
                        for j in cutlass.range_constexpr(8):
                            args.mSampleScales[row, slot, j] = args.mKeyScales[
                                page, key % PAGE_KEYS, j
                            ]


def make_kernel(variant):
    dtype = variant.params["dtype"]
    return SdsaSample(element_type(dtype), nvfp4=dtype == "u8")
