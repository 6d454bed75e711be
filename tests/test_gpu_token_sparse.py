"""token_sparse kernels on the GPU against the PyTorch references, bit for bit: outputs
poisoned before each run (so rows and words the contract leaves alone must stay poisoned),
fresh random inputs, ragged rows, -1 rows, repeated and out-of-range positions, an empty
batch, the largest num_keys, and a CUDA graph replay."""

import pytest
import torch
from sparseforge import reference
from sparseforge.check import group_union_inputs, token_sparse_kv_inputs
from sparseforge.token_sparse import group_union_masks, token_sparse_kv_indices

pytestmark = pytest.mark.gpu

OUTPUTS_KV = ("block_tables", "seq_lens")
OUTPUTS_UNION = ("union", "union_sizes", "mask")


def on_gpu(args):
    return {k: v.cuda() if isinstance(v, torch.Tensor) else v for k, v in args.items()}


def call(function, args, leading):
    """function(*leading args, **the others): the references take the kernels' signatures."""
    return function(
        *(args[k] for k in leading), **{k: v for k, v in args.items() if k not in leading}
    )


def run_both(function, ref, args, outputs, leading):
    """(kernel outputs, reference outputs) from the same poisoned buffers."""
    ref_args = {k: v.clone() if k in outputs else v for k, v in args.items()}
    got = call(function, args, leading)
    want = call(ref, ref_args, leading)
    torch.cuda.synchronize()
    return got, want


KV_LEADING = ("positions", "requests", "block_table")
UNION_LEADING = ("positions", "query_rows", "group_unions", "requests", "block_table")


@pytest.mark.parametrize("rpt", [1, 2, 8])
@pytest.mark.parametrize("t, k", [(1, 512), (37, 2048), (300, 1024)])
def test_kv_indices_match_the_reference(t, k, rpt):
    args = on_gpu(token_sparse_kv_inputs(t=t, k=k, rpt=rpt, seed=t + k + rpt))
    got, want = run_both(
        token_sparse_kv_indices, reference.token_sparse_kv_indices, args, OUTPUTS_KV, KV_LEADING
    )
    for g, w in zip(got, want, strict=True):
        assert torch.equal(g, w)


def test_kv_indices_empty_batch_writes_nothing():
    args = on_gpu(token_sparse_kv_inputs(t=0, k=512, rpt=1))
    call(token_sparse_kv_indices, args, KV_LEADING)
    torch.cuda.synchronize()
    assert torch.all(args["block_tables"] == -7) and torch.all(args["seq_lens"] == -7)


@pytest.mark.parametrize(
    "groups, n, k, num_keys",
    [
        (1, 1, 512, 64),
        (3, 4, 512, 3000),
        (16, 8, 1024, 20000),
        (2, 2, 2048, 262144),
        (5, 3, 512, 129),
    ],
)
def test_group_union_masks_match_the_reference(groups, n, k, num_keys):
    args = on_gpu(group_union_inputs(groups=groups, n=n, k=k, num_keys=num_keys, seed=groups * n))
    got, want = run_both(
        group_union_masks, reference.group_union_masks, args, OUTPUTS_UNION, UNION_LEADING
    )
    for name, g, w in zip(OUTPUTS_UNION, got, want, strict=True):
        assert torch.equal(g, w), name


def test_group_union_masks_full_rows():
    """Every position valid and distinct within a group: U = n K columns, every word written."""
    groups, n, k = 4, 2, 512
    args = group_union_inputs(groups=groups, n=n, k=k, num_keys=8192)
    args["positions"] = torch.randperm(8192)[: groups * n * k].view(groups * n, k).int()
    args["query_rows"] = torch.arange(groups * n).int()
    args["group_unions"] = torch.arange(groups).int()
    got, want = run_both(
        group_union_masks, reference.group_union_masks, on_gpu(args), OUTPUTS_UNION, UNION_LEADING
    )
    for name, g, w in zip(OUTPUTS_UNION, got, want, strict=True):
        assert torch.equal(g, w), name
    assert torch.all(got[1][:groups] == n * k)


def test_kernels_replay_in_a_cuda_graph():
    kv = on_gpu(token_sparse_kv_inputs(t=64, k=1024, rpt=2))
    un = on_gpu(group_union_inputs(groups=8, n=4, k=512, num_keys=5000))

    def launch_both():
        call(token_sparse_kv_indices, kv, KV_LEADING)
        call(group_union_masks, un, UNION_LEADING)

    launch_both()  # binds before capture
    want = [kv[n].clone() for n in OUTPUTS_KV] + [un[n].clone() for n in OUTPUTS_UNION]
    for name in OUTPUTS_KV:
        kv[name].fill_(-9)
    for name in OUTPUTS_UNION:
        un[name].fill_(-9)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        launch_both()
    graph.replay()
    torch.cuda.synchronize()
    got = [kv[n] for n in OUTPUTS_KV] + [un[n] for n in OUTPUTS_UNION]
    for g, w in zip(got, want, strict=True):
        # The graph wrote over -9 what the eager run wrote over -7: compare written entries.
        assert torch.equal(g[w != -7], w[w != -7])
