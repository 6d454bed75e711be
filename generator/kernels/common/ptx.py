"""One PTX instruction (or a short block) where the DSL has no operation for it."""

import cutlass
from cutlass._mlir.dialects import llvm
from cutlass.cutlass_dsl import dsl_user_op


def inline_ptx(result_type, operands, asm, constraints, *, side_effects=False, loc=None, ip=None):
    """The value of `asm` (AT&T operand syntax: $0 the result, $1.. the operands) over the
    DSL values `operands`, as `result_type` (a cutlass numeric type; None: a statement with
    no value, its operands then $0..)."""
    value = llvm.inline_asm(
        None if result_type is None else result_type.mlir_type,
        [x.ir_value(loc=loc, ip=ip) for x in operands],
        asm,
        constraints,
        has_side_effects=side_effects,
        is_align_stack=False,
        asm_dialect=llvm.AsmDialect.AD_ATT,
    )
    return None if result_type is None else result_type(value)


@dsl_user_op
def load_u16(address, *, loc=None, ip=None):
    """The 16 bits at a global byte address (2-byte aligned), through the read-only data
    path: one load where the DSL, not knowing the alignment, issues two byte loads."""
    operands = [cutlass.Int64(address)]
    return inline_ptx(
        cutlass.Uint16, operands, "ld.global.nc.u16 $0, [$1];", "=h,l", loc=loc, ip=ip
    )


@dsl_user_op
def e4m3_pair_as_f16x2(word, high: bool, *, loc=None, ip=None):
    """Bytes 0, 1 (or 2, 3 when high) of a 32-bit word, two e4m3 values, as two fp16 in one
    32-bit word (the low byte in the low half): one conversion with the pairing fixed (the
    vectorizer, left to pair scalar conversions, may pair across words and pay permutes)."""
    half = "h" if high else "l"
    asm = f"{{ .reg .b16 l, h; mov.b32 {{l, h}}, $1; cvt.rn.f16x2.e4m3x2 $0, {half}; }}"
    return inline_ptx(cutlass.Int32, [cutlass.Int32(word)], asm, "=r,r", loc=loc, ip=ip)


@dsl_user_op
def mul_f16x2(a, b, *, loc=None, ip=None):
    """The halfwise product of two words of two fp16 each (round to nearest)."""
    operands = [cutlass.Int32(a), cutlass.Int32(b)]
    return inline_ptx(cutlass.Int32, operands, "mul.rn.f16x2 $0, $1, $2;", "=r,r,r", loc=loc, ip=ip)


@dsl_user_op
def f16x2_broadcast(word, high: bool, *, loc=None, ip=None):
    """The low (or high) fp16 of a word in both halves."""
    half = "h" if high else "l"
    asm = f"{{ .reg .b16 l, h; mov.b32 {{l, h}}, $1; mov.b32 $0, {{{half}, {half}}}; }}"
    return inline_ptx(cutlass.Int32, [cutlass.Int32(word)], asm, "=r,r", loc=loc, ip=ip)


@dsl_user_op
def opaque_int32(value, *, loc=None, ip=None):
    """value, through an asm move the optimizer may not look through or move: what is
    computed from it stays where it is written (e.g. loads of read-only memory that would
    otherwise be hoisted out of a loop, and their registers kept live across it)."""
    operands = [cutlass.Int32(value)]
    return inline_ptx(
        cutlass.Int32, operands, "mov.b32 $0, $1;", "=r,r", side_effects=True, loc=loc, ip=ip
    )


@dsl_user_op
def store_int32x4_broadcast(address, value, *, loc=None, ip=None):
    """`value` into the four 32-bit words at a global byte address (16-byte aligned): one
    vector store."""
    operands = [cutlass.Int64(address), cutlass.Int32(value)]
    asm = "st.global.v4.b32 [$0], {$1, $1, $1, $1};"
    inline_ptx(None, operands, asm, "l,r", side_effects=True, loc=loc, ip=ip)


@dsl_user_op
def bulk_copy_g2s(dst_shared, src_global, size, barrier_shared, *, loc=None, ip=None):
    """`size` bytes (a multiple of 16; both addresses 16-byte aligned) from a global byte
    address to a shared one by the TMA unit, completing that many transaction bytes on the
    mbarrier at `barrier_shared` (the DSL's copy atoms want a tensor map or a CuTe copy;
    a page is one flat run of bytes)."""
    operands = [
        cutlass.Int32(dst_shared),
        cutlass.Int64(src_global),
        cutlass.Int32(size),
        cutlass.Int32(barrier_shared),
    ]
    asm = "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [$0], [$1], $2, [$3];"
    inline_ptx(None, operands, asm, "r,l,r,r", side_effects=True, loc=loc, ip=ip)
