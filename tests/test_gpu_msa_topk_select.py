"""msa_topk_select on the GPU against the PyTorch reference, id for id: ties (scores on a
coarse grid), -inf and NaN blocks, forced blocks, valid pages as None, a scalar and per
token, fewer blocks than 16, output poisoned before the run, and CUDA graph captures."""

import pytest
import torch
from sparseforge import reference
from sparseforge.check import topk_scores
from sparseforge.msa_ops import msa_topk_select

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize(
    "heads, blocks, tokens, fb, fe, nvp",
    [
        (4, 256, 300, 1, 1, "tensor"),
        (2, 256, 129, 0, 0, None),
        (8, 64, 1000, 2, 2, "scalar"),
        (1, 10, 77, 1, 1, None),
        (3, 2048, 40, 16, 0, "tensor"),
        (2, 100, 33, 0, 16, "tensor"),
        (64, 32, 500, 1, 1, "tensor"),
    ],
)
def test_matches_the_reference(heads, blocks, tokens, fb, fe, nvp):
    score, per_token = topk_scores(heads, blocks, tokens, seed=heads * blocks, per_token=True)
    valid = {None: None, "scalar": blocks // 2 + 1, "tensor": per_token}[nvp]
    score = score.cuda()
    if isinstance(valid, torch.Tensor):
        valid = valid.cuda()
    out = torch.full((tokens, heads, 16), -7, dtype=torch.int32, device="cuda")
    got = msa_topk_select(score, 16, valid, out, fb, fe)
    assert got is out
    want = reference.msa_topk_select(score, 16, valid, fb, fe)
    torch.cuda.synchronize()
    assert torch.equal(got, want)


@pytest.mark.parametrize("blocks", [200, 256, 512])
def test_distinct_scores_match_torch_topk(blocks):
    """Without ties or -inf, the middle choice is torch.topk's (one segment of 256 blocks
    and two)."""
    heads, tokens = 4, 256
    score = torch.randn(heads, blocks, tokens, device="cuda")
    got = msa_topk_select(score, 16)
    want = score.topk(16, dim=1).indices.sort(1).values.permute(2, 0, 1).int()
    assert torch.equal(got, want)


def test_ties_in_some_rows_only():
    """Rows with ties at the threshold beside rows without, in the same warps (tokens
    next to each other): each row as the reference has it."""
    heads, blocks, tokens = 4, 256, 300
    score = torch.randn(heads, blocks, tokens, device="cuda")
    score[:, :, ::5] = (score[:, :, ::5] * 2).round()
    got = msa_topk_select(score, 16, None, None, 1, 1)
    assert torch.equal(got, reference.msa_topk_select(score, 16, None, 1, 1))


def test_replays_in_a_cuda_graph():
    score, valid = topk_scores(4, 128, 200, seed=1)
    score, valid = score.cuda(), valid.cuda()
    out = torch.empty(200, 4, 16, dtype=torch.int32, device="cuda")
    msa_topk_select(score, 16, valid, out, 1, 1)  # binds before capture
    want = out.clone()
    out.fill_(-9)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        msa_topk_select(score, 16, valid, out, 1, 1)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, want)


def test_a_count_first_given_in_a_capture_is_right_eagerly():
    """A scalar num_valid_pages first given inside a CUDA graph capture, then eagerly before
    any replay: the eager call reads that count, not a kept tensor whose fill only the
    graph would run."""
    score, _ = topk_scores(4, 128, 200, seed=3)
    score = score.cuda()
    valid = 41  # a count no other test gives first
    out = torch.empty(200, 4, 16, dtype=torch.int32, device="cuda")
    msa_topk_select(score, 16, None, out, 1, 1)  # loads the kernel before the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        msa_topk_select(score, 16, valid, out, 1, 1)
    got = msa_topk_select(score, 16, valid, None, 1, 1)
    assert torch.equal(got, reference.msa_topk_select(score, 16, valid, 1, 1))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, got)


def shaped_rows(score):
    """Rows (token t, every head) shaped against a kernel that holds a row's blocks in four
    lanes of 64 (a lane's blocks k, k + 16, k + 32, k + 48 alike): the top scores packed
    into one lane or into a few of those strided groups, finite scores in a few groups
    only, pairs of high scores, a run of high neighbours, one value everywhere."""
    blocks = torch.arange(score.shape[1], device=score.device)
    high = torch.arange(1000.0, 1000.0 + score.shape[1], device=score.device)
    for t in range(score.shape[2]):
        kind = t % 7
        if kind == 1:  # the top scores in 4 strided groups of lane 0
            chosen = (blocks < 64) & (blocks % 16 < 4)
            score[:, chosen, t] = high[: int(chosen.sum())]
        elif kind == 2:  # 40 high scores in one lane
            score[:, 64:104, t] = high[:40]
        elif kind == 3:  # finite scores in 4 groups only: fewer than kept
            finite = (blocks < 64) & (blocks % 16 < 4)
            score[:, ~finite, t] = -torch.inf
        elif kind == 4:  # two high scores in some groups
            score[:, [5, 21, 70, 86, 133, 149], t] += 50.0
        elif kind == 5:  # a run of high neighbouring blocks
            score[:, 40:60, t] += 20.0
        elif kind == 6:  # one value everywhere: every block ties at the threshold
            score[:, :, t] = 0.5
    return score


@pytest.mark.parametrize("fb, fe", [(1, 1), (0, 0), (2, 3)])
def test_shaped_rows_beside_random_ones(fb, fe):
    """Every seventh row random, the others shaped (shaped_rows), in the same warps: each
    as the reference has it."""
    heads, blocks, tokens = 3, 256, 112
    score = shaped_rows(torch.randn(heads, blocks, tokens, device="cuda"))
    out = torch.full((tokens, heads, 16), -7, dtype=torch.int32, device="cuda")
    got = msa_topk_select(score, 16, None, out, fb, fe)
    assert torch.equal(got, reference.msa_topk_select(score, 16, None, fb, fe))
