"""One PTX instruction (or a short block) where the DSL has no operation for it."""

import cutlass
from cutlass._mlir.dialects import llvm
from cutlass.cutlass_dsl import dsl_user_op


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


@dsl_user_op
def load_u16(address, *, loc=None, ip=None):
    """The 16 bits at a global byte address (2-byte aligned), through the read-only data
    path: one load where the DSL, not knowing the alignment, issues two byte loads."""
    operands = [cutlass.Int64(address)]
    return inline_ptx(
        cutlass.Uint16, operands, "ld.global.nc.u16 $0, [$1];", "=h,l", loc=loc, ip=ip
    )
