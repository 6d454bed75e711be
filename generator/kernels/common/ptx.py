"""One PTX instruction (or a short block) where the DSL has no operation for it."""

from cutlass._mlir.dialects import llvm


def inline_ptx(result_type, operands, asm, constraints, *, side_effects=False, loc=None, ip=None):
    """The value of `asm` (AT&T operand syntax: $0 the result, $1.. the operands) over the
    DSL values `operands`, as `result_type` (a cutlass numeric type)."""
    value = llvm.inline_asm(
        result_type.mlir_type,
        [x.ir_value(loc=loc, ip=ip) for x in operands],
        asm,
        constraints,
        has_side_effects=side_effects,
        is_align_stack=False,
        asm_dialect=llvm.AsmDialect.AD_ATT,
    )
    return result_type(value)
