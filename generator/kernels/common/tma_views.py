"""Views of the attention operands as TMA loads them."""

import cutlass.cute as cute


def seq_d_heads(m, head_dim: int):
    """A (seq, heads, D) tensor as (seq, D, heads): rows of D contiguous values a token, the
    K-major operand layout TMA copies tile by tile."""
    return cute.make_tensor(
        m.iterator,
        cute.make_layout((m.shape[0], head_dim, m.shape[1]), stride=(m.stride[0], 1, m.stride[1])),
    )
