"""msa_topk_select on the CPU: the reference against a plain Python reading of the contract
(ties, -inf and NaN scores, forced blocks, per-token valid pages, fewer blocks than 16), and
every argument error before launch."""

import math

import pytest
import torch
from sparseforge import reference
from sparseforge.check import topk_scores
from sparseforge.msa_ops import msa_topk_select


def plain_select(scores, nvp, fb, fe, topk=16):
    """One (token, head): the contract read literally."""
    finite = [s > -math.inf for s in scores]  # False for -inf and NaN
    begin = list(range(min(fb, nvp)))
    end = list(range(max(nvp - fe, len(begin)), nvp))
    middle = range(len(begin), max(nvp - fe, len(begin)))
    ranked = sorted((b for b in middle if finite[b]), key=lambda b: (-scores[b], b))
    chosen = ranked[: topk - fb - fe]
    ids = sorted([b for b in begin + end if finite[b]] + chosen)
    return ids + [-1] * (topk - len(ids))


@pytest.mark.parametrize(
    "heads, blocks, tokens, fb, fe, per_token",
    [
        (2, 40, 7, 0, 0, False),
        (3, 64, 5, 1, 1, False),
        (1, 300, 4, 2, 3, True),
        (2, 10, 3, 1, 1, False),  # fewer blocks than 16
        (2, 33, 6, 16, 0, True),
        (1, 20, 9, 4, 12, True),
    ],
)
def test_reference_reads_the_contract(heads, blocks, tokens, fb, fe, per_token):
    score, nvp = topk_scores(heads, blocks, tokens, seed=blocks + fb, per_token=per_token)
    got = reference.msa_topk_select(score, 16, nvp, fb, fe)
    assert got.shape == (tokens, heads, 16) and got.dtype == torch.int32
    for s in range(tokens):
        valid = blocks if nvp is None else int(nvp[s])
        for h in range(heads):
            want = plain_select(score[h, :, s].tolist(), valid, fb, fe)
            assert got[s, h].tolist() == want, (s, h)


def test_scalar_num_valid_pages():
    score, _ = topk_scores(2, 50, 4, seed=3, per_token=False)
    assert torch.equal(
        reference.msa_topk_select(score, 16, 30, 1, 1),
        reference.msa_topk_select(score, 16, torch.full((4,), 30, dtype=torch.int32), 1, 1),
    )


SCORES = torch.zeros(5, 32)  # max_score and, in one case, the output in the same memory


@pytest.mark.parametrize(
    "kwargs, error, message",
    [
        (dict(topk=8), ValueError, "topk must be 16, got 8"),
        (
            dict(max_score=torch.zeros(2, 4, 5, dtype=torch.float16)),
            ValueError,
            "float32 (Hq, P, S)",
        ),
        (dict(max_score=torch.zeros(2, 5, 4).transpose(1, 2)), ValueError, "must be contiguous"),
        (
            dict(max_score=torch.empty(1, 1, 2**30, device="meta")),
            ValueError,
            "has 1073741824 tokens (S); msa_topk_select takes fewer than 2^30",
        ),
        (dict(force_begin_blocks=9, force_end_blocks=8), ValueError, "= 17 exceeds topk 16"),
        (dict(force_end_blocks=-1), ValueError, "force_end_blocks must be an int >= 0"),
        (dict(num_valid_pages=0), ValueError, "num_valid_pages must be in (0, 4] (P), got 0"),
        (dict(num_valid_pages=5), ValueError, "(0, 4]"),
        (
            dict(num_valid_pages=torch.zeros(5, dtype=torch.int64)),
            ValueError,
            "int32 tensor of shape (5,)",
        ),
        (dict(num_valid_pages=torch.zeros(4, dtype=torch.int32)), ValueError, "shape (5,)"),
        (dict(num_valid_pages=2.0), TypeError, "num_valid_pages must be None, an int"),
        (dict(output=torch.zeros(5, 2, 8, dtype=torch.int32)), ValueError, "shape (5, 2, 16)"),
        (
            dict(output=SCORES.view(torch.int32)[:5].view(5, 2, 16)),
            ValueError,
            "output spans overlaps",
        ),
        (dict(), ValueError, "msa_topk_select needs a CUDA device"),
    ],
)
def test_errors(kwargs, error, message):
    args = dict(max_score=SCORES.flatten()[:40].view(2, 4, 5), topk=16)
    args.update(kwargs)
    with pytest.raises(error) as info:
        msa_topk_select(**args)
    assert message in str(info.value)


def test_the_kernels_networks_sort_every_zero_one_input():
    """The 0-1 principle: a comparator network that sorts every 0-1 input sorts every
    input. The group sort (all 2^16 inputs) and the fold's merge (every bitonic 0-1 input:
    ones then zeros then ones, or the reverse) of the top-16 kernel."""
    pytest.importorskip("cutlass")
    from generator.kernels.portable import msa_topk_select as kernel

    def run(pairs, x):
        x = x.clone()
        for i, j, descending in pairs:
            high, low = torch.maximum(x[:, i], x[:, j]), torch.minimum(x[:, i], x[:, j])
            x[:, i], x[:, j] = (high, low) if descending else (low, high)
        return x

    every = (torch.arange(1 << 16)[:, None] >> torch.arange(16)) & 1
    assert (run(kernel.SORT_GROUP, every).diff(dim=1) <= 0).all()
    assert len(kernel.SORT_GROUP) == 63
    bitonic = [
        [int(a <= i < b) ^ flip for i in range(16)]
        for a in range(17)
        for b in range(a, 17)
        for flip in (0, 1)
    ]
    assert (run(kernel.MERGE_BEST, torch.tensor(bitonic)).diff(dim=1) <= 0).all()
