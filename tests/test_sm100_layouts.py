"""The tcgen05 templates' hand-written views of their shared-memory operands, checked on the
CPU against the MMA's own partitions (no SM100 here runs them): the Q tile's (row, channel)
view that a unit's TMA load writes through, and the V stage's (key, channel) view that
zeroes keys past a short tile."""

import pytest

cutlass = pytest.importorskip("cutlass")
cute = pytest.importorskip("cutlass.cute")

from generator import aot  # noqa: E402,F401  (loads the DSL runtime for compiles here)
from generator.kernels.sm100.block_sparse_fwd import TILE_M, BlockSparseFwdTcgen05  # noqa: E402
from generator.kernels.sm100.sage_fp8_fwd import SageFp8FwdTcgen05  # noqa: E402

TILE_KEYS = 64
SAMPLES = (0, 1, 17, 127, 128, 1000, 2047, 2048, 4095, 5000)


def views_agree(kernel) -> list:
    """(what, flat index) of every sampled element where a view and the MMA's partition
    disagree; empty when they agree."""
    d = kernel.head_dim
    bad = []

    # No AST rewriting: plain Python loops and branches over static layouts.
    @cute.jit(preprocess=False)
    def check():
        qk, pv = kernel.tiled_mmas()
        rows = qk.get_slice(0).partition_A(cute.make_identity_tensor((TILE_M, d)))
        for i in SAMPLES:
            if i < TILE_M * d and int(cute.crd2idx(rows[i], kernel.rows_by_k(TILE_M))) != i:
                bad.append(("Q rows", i))
        keys = pv.get_slice(0).partition_B(cute.make_identity_tensor((d, TILE_KEYS)))
        for i in SAMPLES:
            if i < d * TILE_KEYS:
                channel, key = keys[i]
                if int(cute.crd2idx((key, channel), kernel.keys_by_channel())) != i:
                    bad.append(("V keys", i))

    cute.compile(check, options="--gpu-arch sm_100f")
    return bad


@pytest.mark.parametrize("head_dim", [64, 128, 256])
def test_16_bit_views_follow_the_mma_partitions(head_dim):
    assert views_agree(BlockSparseFwdTcgen05(cutlass.BFloat16, head_dim, 2)) == []


@pytest.mark.parametrize("head_dim", [64, 128])
def test_e4m3_views_follow_the_mma_partitions(head_dim):
    assert views_agree(SageFp8FwdTcgen05(head_dim, 2)) == []


@pytest.mark.parametrize(
    "kernel",
    [BlockSparseFwdTcgen05(cutlass.BFloat16, d, u) for d in (64, 128, 256) for u in (1, 2)]
    + [SageFp8FwdTcgen05(d, u) for d in (64, 128) for u in (1, 2)],
    ids=lambda k: f"{type(k).__name__}_d{k.head_dim}_u{k.units}",
)
def test_tensor_memory_and_shared_memory_fit(kernel):
    """TMEM: O buffers, two S buffers and P side by side in a power-of-two allocation of at
    most the SM's 512 columns. Shared memory: the Q tile and the ring (at least two stages)
    within a CTA's 227 KB, with 2 KB for the barriers and the 1 KB alignments."""
    d = kernel.head_dim
    o_end = kernel.o_col + kernel.O_BUFFERS * d
    s_end = kernel.s_col + 2 * TILE_KEYS
    p_end = kernel.p_col + TILE_KEYS * kernel.dtype.width // 32
    assert kernel.o_col == 0 and o_end <= kernel.s_col and s_end <= kernel.p_col
    assert p_end <= kernel.tmem_alloc <= 512
    assert kernel.tmem_alloc & (kernel.tmem_alloc - 1) == 0
    q_bytes = TILE_M * d * kernel.dtype.width // 8
    assert kernel.kv_stages >= 2
    assert q_bytes + kernel.kv_stages * kernel.tile_bytes + 2048 <= 227 * 1024
