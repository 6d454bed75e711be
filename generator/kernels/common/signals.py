"""Memory other GPUs write or read (rows and ready flags behind peer-visible pointers): plain
and system-scope loads and stores by byte address, and the bounded wait for a flag.

Reads of such memory bypass the L1 (relaxed / acquire at system scope): an SM may hold a
line of a slot set from an earlier use, which a peer has since rewritten. A row's words are
made visible before its flag by a release store of the flag after the CTA's barrier (the
barrier orders the other threads' stores before the flag-writing thread's release).
"""

import cutlass
import cutlass.cute as cute
from cutlass.cutlass_dsl import dsl_user_op

from generator.kernels.common.ptx import inline_ptx


@dsl_user_op
def store_b32(address, value, *, loc=None, ip=None):
    """A plain 32-bit store to a global byte address."""
    operands = [cutlass.Int64(address), cutlass.Int32(value)]
    inline_ptx(None, operands, "st.global.b32 [$0], $1;", "l,r", side_effects=True, loc=loc, ip=ip)


@dsl_user_op
def store_relaxed_b64(address, value, *, loc=None, ip=None):
    """A 64-bit store, single-copy atomic at system scope (a tagged row's word: its
    generation and value are seen together or not at all)."""
    operands = [cutlass.Int64(address), cutlass.Int64(value)]
    inline_ptx(
        None,
        operands,
        "st.relaxed.sys.global.b64 [$0], $1;",
        "l,l",
        side_effects=True,
        loc=loc,
        ip=ip,
    )


@dsl_user_op
def store_release_b32(address, value, *, loc=None, ip=None):
    """A flag store that orders every earlier access of the thread (and, after a barrier,
    of its CTA) before it, at system scope."""
    operands = [cutlass.Int64(address), cutlass.Int32(value)]
    inline_ptx(
        None,
        operands,
        "st.release.sys.global.b32 [$0], $1;",
        "l,r",
        side_effects=True,
        loc=loc,
        ip=ip,
    )


@dsl_user_op
def load_relaxed_b32(address, *, loc=None, ip=None):
    """A 32-bit load at system scope (not from a possibly stale L1 line)."""
    operands = [cutlass.Int64(address)]
    return inline_ptx(
        cutlass.Int32, operands, "ld.relaxed.sys.global.b32 $0, [$1];", "=r,l",
        side_effects=True, loc=loc, ip=ip,
    )  # fmt: skip


@dsl_user_op
def load_relaxed_b64(address, *, loc=None, ip=None):
    """A 64-bit load at system scope, single-copy atomic (a tagged row's word)."""
    operands = [cutlass.Int64(address)]
    return inline_ptx(
        cutlass.Int64, operands, "ld.relaxed.sys.global.b64 $0, [$1];", "=l,l",
        side_effects=True, loc=loc, ip=ip,
    )  # fmt: skip


@dsl_user_op
def load_acquire_b32(address, *, loc=None, ip=None):
    """A flag load that orders every later access of the thread after it, at system scope."""
    operands = [cutlass.Int64(address)]
    return inline_ptx(
        cutlass.Int32, operands, "ld.acquire.sys.global.b32 $0, [$1];", "=r,l",
        side_effects=True, loc=loc, ip=ip,
    )  # fmt: skip


@dsl_user_op
def count_error_and_trap(errors_address, *, loc=None, ip=None):
    """Adds one to the error counter at a global byte address, then stops the kernel (the
    launch fails with an illegal-instruction error the host sees at its next
    synchronisation, rather than waiting forever for a peer that is gone)."""
    operands = [cutlass.Int64(errors_address)]
    asm = "{ .reg .b32 old; atom.global.add.u32 old, [$0], 1; membar.sys; trap; }"
    inline_ptx(None, operands, asm, "l", side_effects=True, loc=loc, ip=ip)


@cute.jit
def wait_for_flag(address, want, spin_limit, errors_address):
    """Polls the flag at `address` (acquire) until it reads `want`; after spin_limit polls
    counts an error and traps."""
    polls = cutlass.Int32(0)
    flag = load_acquire_b32(address)
    while (flag != want) & (polls < spin_limit):
        polls = polls + 1
        flag = load_acquire_b32(address)
    if flag != want:
        count_error_and_trap(errors_address)
