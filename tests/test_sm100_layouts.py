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
