"""Kernels that give each item of a flat index space to one thread, THREADS_PER_CTA threads
a CTA (nvfp4_kv_write, rope_llama, sdsa_quantize, sdsa_sample)."""

import cutlass.cute as cute

THREADS_PER_CTA = 128


@cute.jit
def launch_thread_items(kernel, items, stream):
    """Launch `kernel` (a kernel bound to its arguments) with a thread for each of `items`."""
    kernel.launch(
        grid=[cute.ceil_div(items, THREADS_PER_CTA), 1, 1],
        block=[THREADS_PER_CTA, 1, 1],
        stream=stream,
    )


@cute.jit
def thread_item():
    """The calling thread's item: items past the problem's are the last CTA's idle threads."""
    tidx, _, _ = cute.arch.thread_idx()
    bidx, _, _ = cute.arch.block_idx()
    return bidx * THREADS_PER_CTA + tidx


@cute.jit
def split_item(item, inner, middle):
    """(inner index, middle index, outer index) of `item` in an (outer, middle, inner)
    row-major space."""
    return item % inner, (item // inner) % middle, item // (inner * middle)
