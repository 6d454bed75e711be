"""The ICP indexer's kernels and chains (sparseforge.msa_icp) against the PyTorch reference
(sparseforge.reference_icp), on the GPU.

The scorer against rank_scores (W = 2, 4; P128, P256 compact and not; ragged prefill with
query offsets, decode with 1 to 8 query tokens, pages out of order, an id outside the
shard); the select against local_top16 word for word (ties, NaN, -0, -inf, ids past 8192,
nvp 0, forced blocks); the merge against merge (duplicates, ids out of range); the W-rank
simulation of both chains on one GPU, id for id against the top-16 of the global block
maxima; legacy and tagged publishes over 10,000 decode steps; a wait that times out; CUDA
graph replay; the fused paths (list scorer and list merge) equal to the chains, word for
word; with 2 or 4 GPUs, the chains across them (tests/icp_torchrun.py).
"""

import math
import os
import subprocess
import sys

import pytest
import torch
from sparseforge import check, msa_icp
from sparseforge import reference_icp as ref
from sparseforge.msa_icp import MSAIcpComm

pytestmark = pytest.mark.gpu
HEADS, TOPK, WORDS = 4, 16, 33


# ---- problems ------------------------------------------------------------------------------


def assert_close_scores(got, want):
    assert check.icp_close_scores(got, want), "scores differ from the reference"


def prefill_inputs(p, rank):
    seqs = p["seqs"]
    q = torch.cat([s["q"] for s in seqs]).cuda()
    lens_q = torch.tensor([s["q"].shape[0] for s in seqs], dtype=torch.int32)
    lens_k = torch.tensor([s["k"].shape[0] for s in seqs], dtype=torch.int32)
    offsets = torch.tensor([s["offset"] for s in seqs], dtype=torch.int32)
    plan = msa_icp.msa_icp_index_score_sharded_plan(
        lens_q, lens_k, 4, qo_offset=offsets, device="cuda"
    )
    return q, p["shards"][rank].cuda(), p["table"].cuda(), plan


# ---- GPU: the kernels ----------------------------------------------------------------------


@pytest.mark.parametrize(
    "world, page, compact",
    [(2, 128, False), (4, 128, False), (2, 256, True), (4, 256, True), (4, 256, False)],
)
def test_prefill_scores_match_the_reference(world, page, compact):
    p = check.icp_sharded_problem(
        [700, 1500, 129], [100, 37, 129], world, page, seed=world + page + compact
    )
    width = msa_icp.msa_icp_index_score_columns(1500, page if compact else 128) + 2
    for rank in range(world):
        q, k, table, plan = prefill_inputs(p, rank)
        out = torch.full((q.shape[0], HEADS, width), 7.0, device="cuda")
        msa_icp.msa_icp_index_score_sharded(
            q, k, table, plan, rank=rank, max_score=out, tp=world, compact=compact
        )
        assert_close_scores(out.cpu(), check.icp_expected_rank_scores(p, rank, compact, width))


@pytest.mark.parametrize("world, page", [(4, 128), (2, 128), (2, 256)])
def test_portable_scorer_where_a_native_one_exists(monkeypatch, world, page):
    """The mma.sync scorer SM100 and SM120 run (32, 64, 128 shard rows), forced on this GPU,
    in prefill and decode."""
    from sparseforge.families import msa_icp as family

    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the forced variants are the sm_90a build's")
    variant = f"msa_icp_score__warp_mma__e4m3_d128_r{page // world}__sm_90a"
    monkeypatch.setenv("SPARSEFORGE_VARIANT", variant)
    family.launch.cache_clear()
    try:
        p = check.icp_sharded_problem([700, 1500], [100, 37], world, page, seed=world)
        width = msa_icp.msa_icp_index_score_columns(1500, page) + 1
        for rank in range(world):
            q, k, table, plan = prefill_inputs(p, rank)
            out = torch.full((q.shape[0], HEADS, width), 7.0, device="cuda")
            msa_icp.msa_icp_index_score_sharded(
                q, k, table, plan, rank=rank, max_score=out, tp=world, compact=True
            )
            assert_close_scores(out.cpu(), check.icp_expected_rank_scores(p, rank, True, width))
        lengths = [300, 2000]
        p = check.icp_sharded_problem(lengths, [3, 3], world, page, seed=1)
        cols = msa_icp.msa_icp_decode_score_columns(2000, page)
        for rank in range(world):
            out = torch.full((6, HEADS, cols), 7.0, device="cuda")
            msa_icp.msa_icp_decode_index_score_sharded(
                torch.cat([s["q"] for s in p["seqs"]]).cuda(), p["shards"][rank].cuda(),
                p["table"].cuda(), torch.tensor(lengths, dtype=torch.int32, device="cuda"), out,
                rank=rank, world_size=world, page_size=page, decode_query_len=3,
                max_decode_query_len=3,
            )  # fmt: skip
            want = check.icp_expected_rank_scores(p, rank, True, cols)
            for b, n in enumerate(lengths):
                written = -(-n // (4 * page)) * 4  # the pages, rounded up to four
                rows = slice(3 * b, 3 * b + 3)
                assert_close_scores(out.cpu()[rows, :, :written], want[rows, :, :written])
    finally:
        family.launch.cache_clear()


@pytest.mark.parametrize("page", [128, 256])
def test_a_page_id_outside_the_shard_holds_no_key(page):
    """A block-table entry past the shard's pages: the page's columns are -inf, the rest as
    before (prefill and decode)."""
    p = check.icp_sharded_problem([1000, 600], [50, 60], 2, page, seed=page)
    p["table"][0, 1] = p["shards"][0].shape[0] + 5
    width = msa_icp.msa_icp_index_score_columns(1000, page)
    for rank in range(2):
        q, k, table, plan = prefill_inputs(p, rank)
        out = torch.full((q.shape[0], HEADS, width), 7.0, device="cuda")
        msa_icp.msa_icp_index_score_sharded(
            q, k, table, plan, rank=rank, max_score=out, compact=True
        )
        want = check.icp_expected_rank_scores(p, rank, True, width)
        want[:50, :, 1] = -math.inf  # sequence 0's page 1
        assert_close_scores(out.cpu(), want)


def test_prefill_scores_without_initialize_leave_unfilled_columns():
    p = check.icp_sharded_problem([300], [40], 2, 128, seed=3, q_offsets=[10])
    q, k, table, plan = prefill_inputs(p, 1)
    out = torch.full((40, HEADS, 8), 7.0, device="cuda")
    msa_icp.msa_icp_index_score_sharded(q, k, table, plan, rank=1, max_score=out, initialize=False)
    want = check.icp_expected_rank_scores(p, 1, False, 8)
    # Token i (position 10 + i) sees pages up to its block; a later column keeps its value
    # or is -inf (the page of a later token of the same CTA: the true score there).
    for i in range(40):
        seen = (10 + i) // 128 + 1
        assert_close_scores(out[i, :, :seen].cpu(), want[i, :, :seen])
        rest = out[i, :, seen:]
        assert bool(((rest == 7.0) | (rest == -math.inf)).all())


@pytest.mark.parametrize("world, page", [(2, 128), (4, 128), (2, 256), (4, 256)])
@pytest.mark.parametrize("dql", [1, 3, 8])
def test_decode_scores_match_the_reference(world, page, dql):
    lengths = [1, 200, 1300, 4 * page + 5]
    p = check.icp_sharded_problem(lengths, [dql] * len(lengths), world, page, seed=dql)
    cols = msa_icp.msa_icp_decode_score_columns(max(lengths), page) + 4
    for rank in range(world):
        q = torch.cat([s["q"] for s in p["seqs"]]).cuda()
        out = torch.full((q.shape[0], HEADS, cols), 7.0, device="cuda")
        seq_lens = torch.tensor(lengths, dtype=torch.int32, device="cuda")
        msa_icp.msa_icp_decode_index_score_sharded(
            q, p["shards"][rank].cuda(), p["table"].cuda(), seq_lens, out, rank=rank,
            world_size=world, page_size=page, decode_query_len=dql, max_decode_query_len=8,
        )  # fmt: skip
        want = check.icp_expected_rank_scores(p, rank, True, cols)
        got = out.cpu()
        for b, n in enumerate(lengths):
            pages = -(-n // page)
            written = -(-pages // 4) * 4
            rows = slice(b * dql, (b + 1) * dql)
            assert_close_scores(got[rows, :, :written], want[rows, :, :written])
            assert bool((got[rows, :, written:] == 7.0).all()), "a column past the rounded pages"


@pytest.mark.parametrize(
    "columns, scale, offset", [(40, 1, 0), (9000, 1, 0), (300, 2, 1), (11000, 2, 0)]
)
@pytest.mark.parametrize("fb, fe", [(0, 0), (2, 3)])
def test_select_writes_the_reference_carrier(columns, scale, offset, fb, fe):
    tokens = 37
    scores = check.icp_random_scores(tokens, columns, seed=columns + fb)
    g = torch.Generator().manual_seed(1)
    nvp = torch.randint(0, scale * columns + 20, (tokens,), generator=g, dtype=torch.int32)
    nvp[0], nvp[1], nvp[2] = 0, 1, 10**6
    ids = torch.arange(columns) * scale + offset
    want = ref.local_top16(scores, ids, nvp, fb, fe).transpose(0, 1)
    big = torch.full((HEADS, tokens + 5, WORDS), -7, dtype=torch.int32, device="cuda")
    carrier = big[:, 2 : 2 + tokens]
    msa_icp.msa_icp_topk_select_prefill(
        scores.cuda(), nvp.cuda(), carrier, force_begin_blocks=fb, force_end_blocks=fe,
        index_scale=scale, index_offset=offset,
    )  # fmt: skip
    assert torch.equal(carrier.cpu(), want)
    assert bool((big[:, :2] == -7).all()) and bool((big[:, 2 + tokens :] == -7).all())


@pytest.mark.parametrize("world", [2, 4])
def test_prefill_merge_matches_the_reference(world):
    tokens = 29
    rows = check.icp_random_carriers(world, tokens, 9000, seed=world)
    g = torch.Generator().manual_seed(5)
    nvp = torch.randint(0, 9100, (tokens,), generator=g, dtype=torch.int32)
    nvp[0], nvp[1] = 0, 12
    want = ref.merge(rows, nvp, 1, 2)
    out = torch.full((tokens, HEADS // world, TOPK), -7, dtype=torch.int32, device="cuda")
    errors = torch.zeros(1, dtype=torch.int32, device="cuda")
    msa_icp.msa_icp_merge_candidates(
        rows.cuda(), nvp.cuda(), out, errors, init_blocks=1, local_blocks=2, prefill=True
    )
    assert torch.equal(out.cpu(), want)
    assert out[0].tolist() == [[0] + [-1] * 15] * (HEADS // world)
    assert errors.item() == 0


# ---- GPU: the chains, W ranks simulated on one GPU ------------------------------------------


def global_maxima(rank_planes, ids_of, blocks):
    """(T, 4, blocks) the global block maxima from every rank's scores (kernel outputs),
    NaN-free: the max over the ranks holding part of each block."""
    t = rank_planes[0].shape[0]
    out = torch.full((t, HEADS, blocks), -math.inf)
    for plane, ids in zip(rank_planes, ids_of, strict=True):
        out[..., ids] = torch.maximum(out[..., ids], plane[..., : ids.shape[0]])
    return out


@pytest.mark.parametrize("world, page", [(2, 128), (4, 128), (2, 256), (4, 256)])
def test_prefill_chain_reproduces_the_unsharded_top16(world, page):
    keys = [2000, 9000 * 128 // 100]  # the second: ~90 blocks
    p = check.icp_sharded_problem(keys, [64, 80], world, page, seed=world * page)
    fb, fe = 1, 2
    blocks = -(-max(keys) // 128)
    width = msa_icp.msa_icp_index_score_columns(max(keys), page)
    tokens = 144
    nvp = torch.cat([s["positions"] // 128 + 1 for s in p["seqs"]]).int().cuda()
    carriers, planes, ids_of = [], [], []
    for rank in range(world):
        q, k, table, plan = prefill_inputs(p, rank)
        scores = torch.empty(tokens, HEADS, width, device="cuda")
        msa_icp.msa_icp_index_score_sharded(
            q, k, table, plan, rank=rank, max_score=scores, tp=world, compact=True
        )
        carrier = torch.empty(HEADS, tokens, WORDS, dtype=torch.int32, device="cuda")
        scale, offset = (1, 0) if page == 128 else (2, 2 * rank // world)
        msa_icp.msa_icp_topk_select_prefill(
            scores, nvp, carrier, force_begin_blocks=fb, force_end_blocks=fe,
            index_scale=scale, index_offset=offset,
        )  # fmt: skip
        carriers.append(carrier)
        planes.append(scores.cpu())
        ids_of.append(torch.arange(width) * scale + offset)
    # The all-to-all as a permute: owner o receives every rank's rows of its heads.
    hpr = HEADS // world
    merged = []
    for owner in range(world):
        received = torch.stack([c[owner * hpr : (owner + 1) * hpr] for c in carriers])
        out = torch.empty(tokens, hpr, TOPK, dtype=torch.int32, device="cuda")
        errors = torch.zeros(1, dtype=torch.int32, device="cuda")
        msa_icp.msa_icp_merge_candidates(
            received, nvp, out, errors, init_blocks=fb, local_blocks=fe, prefill=True
        )
        merged.append(out.cpu())
    got = torch.cat(merged, dim=1)
    ids_of = [ids[ids < blocks] for ids in ids_of]
    want = ref.top16_of_maxima(global_maxima(planes, ids_of, blocks), nvp.cpu(), fb, fe)
    assert torch.equal(got, want)


def decode_chain(plans, comms, p, seq_lens, dql, slot, tagged, scores, outputs, nvp):
    """Every rank's score plane and publish, then every owner's merge (one stream)."""
    q, table = p["q_cuda"], p["table_cuda"]
    world = len(plans)
    for r, plan in enumerate(plans):
        msa_icp.msa_icp_decode_index_score_sharded(
            q, p["shards_cuda"][r], table, seq_lens, scores[r], rank=r, world_size=world,
            page_size=plan.page_size, decode_query_len=dql, max_decode_query_len=8,
        )  # fmt: skip
        scale, offset = (1, 0) if plan.page_size == 128 else (2, 2 * r // world)
        msa_icp.msa_icp_topk_select_publish(
            scores[r], nvp, comms[r].tagged_bases if tagged else comms[r].legacy_bases,
            comms[r].errors, slot=slot, rank=r, world_size=world, heads_per_rank=HEADS // world,
            capacity=comms[r].capacity, force_begin_blocks=plan.init_blocks,
            force_end_blocks=plan.local_blocks, index_scale=scale, index_offset=offset,
            generations=comms[r].generations if tagged else None,
        )  # fmt: skip
    merge_all(plans, comms, slot, tagged, outputs, nvp)


def merge_all(plans, comms, slot, tagged, outputs, nvp):
    """Every owner's merge of slot set `slot` (after every rank's publish)."""
    for r, plan in enumerate(plans):
        msa_icp.msa_icp_merge_candidates(
            comms[r].tagged[slot] if tagged else comms[r].legacy[slot], nvp, outputs[r],
            comms[r].errors, init_blocks=plan.init_blocks, local_blocks=plan.local_blocks,
            expected_generations=comms[r].expected[slot] if tagged else None,
        )  # fmt: skip


def decode_setup(world, page, dql, lengths, seed):
    p = check.icp_sharded_problem(lengths, [dql] * len(lengths), world, page, seed=seed)
    p["shards_cuda"] = [s.cuda() for s in p["shards"]]
    p["q_cuda"] = torch.cat([s["q"] for s in p["seqs"]]).cuda()
    p["table_cuda"] = p["table"].cuda()
    plans = [
        msa_icp.prepare_msa_icp_indexer(
            world_size=world,
            rank=r,
            num_index_heads=4,
            page_size=page,
            init_blocks=1,
            local_blocks=2,
            max_decode_tokens=64,
            max_decode_query_len=8,
            max_num_batched_tokens=8192,
            max_num_seqs=64,
            max_model_len=max(lengths),
            num_sparse_layers=4,
            device="cuda",
        )  # fmt: skip
        for r in range(world)
    ]
    for plan in plans:
        plan.warmup()
    tokens = dql * len(lengths)
    comms = MSAIcpComm.simulated(world, tokens)
    cols = plans[0].decode_score_columns
    scores = [torch.empty(tokens, HEADS, cols, device="cuda") for _ in range(world)]
    outputs = [
        torch.empty(tokens, HEADS // world, TOPK, dtype=torch.int32, device="cuda")
        for _ in range(world)
    ]
    seq_lens = torch.tensor(lengths, dtype=torch.int32, device="cuda")
    blocks = torch.tensor([-(-n // 128) for n in lengths]).repeat_interleave(dql)
    nvp = blocks.int().cuda()
    return p, plans, comms, scores, outputs, seq_lens, nvp


def decode_want(p, plans, scores, seq_lens, dql, nvp):
    world, page = len(plans), plans[0].page_size
    blocks = -(-int(seq_lens.max()) // 128)
    planes, ids_of = [], []
    for r in range(world):
        scale, offset = (1, 0) if page == 128 else (2, 2 * r // world)
        ids = torch.arange(scores[r].shape[2]) * scale + offset
        keep = ids < blocks
        planes.append(scores[r].cpu()[..., keep])
        ids_of.append(ids[keep])
    # Columns past a request's written ones hold stale values: the reference sees -inf there.
    for b, n in enumerate(seq_lens.tolist()):
        for r in range(world):
            stale = ids_of[r] >= -(-n // 128)
            planes[r][b * dql : (b + 1) * dql][..., stale] = -math.inf
    return ref.top16_of_maxima(global_maxima(planes, ids_of, blocks), nvp.cpu(), 1, 2)


@pytest.mark.parametrize("world, page", [(2, 128), (4, 128), (2, 256), (4, 256)])
@pytest.mark.parametrize("tagged", [False, True])
def test_decode_chain_reproduces_the_unsharded_top16(world, page, tagged):
    dql = 2
    lengths = [1, 300, 5000, 20000]
    p, plans, comms, scores, outputs, seq_lens, nvp = decode_setup(
        world, page, dql, lengths, seed=page
    )
    for slot in range(3):
        for out in outputs:
            out.fill_(-7)
        decode_chain(plans, comms, p, seq_lens, dql, slot, tagged, scores, outputs, nvp)
        got = torch.cat([o.cpu() for o in outputs], dim=1)
        assert torch.equal(got, decode_want(p, plans, scores, seq_lens, dql, nvp))
    assert all(c.errors.item() == 0 for c in comms)
    if not tagged:  # every flag the merges waited for is clear again
        assert all(int(c.legacy[..., -1].abs().sum()) == 0 for c in comms)


@pytest.mark.parametrize("tagged", [False, True])
def test_ten_thousand_decode_steps_lose_no_row(tagged):
    """Publish / merge only, rank r's one candidate a step (block marker + r, the rest -inf):
    a stale or lost row would give an old step's ids."""
    world, tokens, cols = 4, 8, 64
    comms = MSAIcpComm.simulated(world, tokens)
    nvp = torch.full((tokens,), cols, dtype=torch.int32, device="cuda")
    scores = [torch.zeros(tokens, HEADS, cols, device="cuda") for _ in range(world)]
    outputs = [torch.empty(tokens, 1, TOPK, dtype=torch.int32, device="cuda") for _ in range(world)]
    bad = torch.zeros(1, dtype=torch.int32, device="cuda")
    for step in range(10_000):
        slot, marker = step % 3, step % cols
        for r in range(world):
            scores[r].fill_(-math.inf)
            scores[r][..., (marker + r) % cols] = 1.0 + step  # rank r's one candidate
            msa_icp.msa_icp_topk_select_publish(
                scores[r], nvp, comms[r].tagged_bases if tagged else comms[r].legacy_bases,
                comms[r].errors, slot=slot, rank=r, world_size=world, heads_per_rank=1,
                capacity=tokens, force_begin_blocks=0, force_end_blocks=0,
                generations=comms[r].generations if tagged else None,
            )  # fmt: skip
        for r in range(world):
            msa_icp.msa_icp_merge_candidates(
                comms[r].tagged[slot] if tagged else comms[r].legacy[slot], nvp, outputs[r],
                comms[r].errors, init_blocks=0, local_blocks=0,
                expected_generations=comms[r].expected[slot] if tagged else None,
            )  # fmt: skip
            best = sorted((marker + j) % cols for j in range(world))
            want = torch.tensor(best + [-1] * (TOPK - world), dtype=torch.int32, device="cuda")
            bad += (outputs[r][:, 0] != want).any().int()
    assert bad.item() == 0
    assert all(c.errors.item() == 0 for c in comms)


def test_a_merge_without_its_publish_counts_an_error_and_traps():
    """In a child process: the trap ends its CUDA context."""
    code = """
import torch
from sparseforge import check, msa_icp
comm = msa_icp.MSAIcpComm.simulated(2, 4)[0]
out = torch.empty(4, 2, 16, dtype=torch.int32, device="cuda")
nvp = torch.full((4,), 5, dtype=torch.int32, device="cuda")
errors = torch.zeros(4, dtype=torch.int32, device="cuda")
msa_icp.msa_icp_merge_candidates(comm.legacy[0], nvp, out, errors, init_blocks=0,
    local_blocks=0, spin_limit=1000)
try:
    torch.cuda.synchronize()
    print("NO TRAP")
except RuntimeError as e:
    print("TRAPPED", type(e).__name__)
"""
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=os.environ
    )
    assert "TRAPPED" in done.stdout, done.stdout + done.stderr


@pytest.mark.parametrize("world", [2, 4])
def test_chains_across_gpus_with_torchrun(world):
    """tests/icp_torchrun.py on W GPUs: NCCL all-to-all, symmetric-memory publish, 10,000
    decode steps."""
    if torch.cuda.device_count() < world:
        pytest.skip(f"needs {world} GPUs, this machine has {torch.cuda.device_count()}")
    script = os.path.join(os.path.dirname(__file__), "icp_torchrun.py")
    done = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={world}", script],
        capture_output=True, text=True, timeout=900,
    )  # fmt: skip
    assert done.returncode == 0 and "ICP torchrun: OK" in done.stdout, done.stdout + done.stderr


# ---- GPU: the fused paths --------------------------------------------------------------------


@pytest.mark.parametrize(
    "world, page, compact", [(2, 128, False), (4, 128, False), (2, 256, True), (4, 256, False)]
)
def test_fused_prefill_writes_the_chains_carrier_rows(world, page, compact):
    """The list scorer uses the score rows' arithmetic (same template), so the carriers are
    equal word for word; padding tokens (nvp 0) and a poisoned pool included."""
    keys = [2000, 9000 * 128 // 100, 129]
    p = check.icp_sharded_problem(keys, [64, 80, 1], world, page, seed=world * page + 1)
    tokens = 145
    width = msa_icp.msa_icp_index_score_columns(max(keys), page if compact else 128)
    nvp = torch.cat([s["positions"] // 128 + 1 for s in p["seqs"]]).int()
    nvp[::7] = 0
    nvp[3] = 9000  # past 8192
    nvp = nvp.cuda()
    for rank in range(world):
        q, k, table, plan = prefill_inputs(p, rank)
        scores = torch.empty(tokens, HEADS, width, device="cuda")
        msa_icp.msa_icp_index_score_sharded(
            q, k, table, plan, rank=rank, max_score=scores, tp=world, compact=compact
        )
        chain = torch.full((HEADS, tokens, WORDS), -7, dtype=torch.int32, device="cuda")
        scale, offset = (2, 2 * rank // world) if page == 256 and compact else (1, 0)
        msa_icp.msa_icp_topk_select_prefill(
            scores, nvp, chain, force_begin_blocks=1, force_end_blocks=2, index_scale=scale,
            index_offset=offset,
        )  # fmt: skip
        pool_bytes = msa_icp.msa_icp_prefill_pool_bytes(total_q=tokens, batch=3, device=q.device)
        pool = torch.full((pool_bytes + 16,), 0x7F, dtype=torch.uint8, device="cuda")
        fused = torch.full((HEADS, tokens, WORDS), -7, dtype=torch.int32, device="cuda")
        msa_icp.msa_icp_prefill_score_select(
            q, k, table, plan, nvp, pool, fused, rank=rank, tp=world, compact=compact,
            force_begin_blocks=1, force_end_blocks=2,
        )  # fmt: skip
        assert torch.equal(fused, chain), f"rank {rank}"


@pytest.mark.parametrize("shard_rows", [32, 64, 128])
def test_fused_prefill_on_exact_scores_matches_the_reference(shard_rows):
    assert check.icp_fused_prefill_match(dict(params=dict(shard_rows=shard_rows)), False, 5)


@pytest.mark.parametrize("splits", [1, 2, 4])
def test_the_list_merge_writes_the_reference_carrier(splits):
    tokens = 300
    lists = check.icp_random_lists(splits, tokens, 9000, seed=splits)
    nvp = torch.randint(0, 9000, (tokens,), dtype=torch.int32)
    nvp[0] = 0
    carrier = torch.full((HEADS, tokens, WORDS), -7, dtype=torch.int32, device="cuda")
    msa_icp.merge_lists_into_carrier(lists.cuda(), nvp.cuda(), carrier, 2, 1)
    assert torch.equal(carrier.cpu(), ref.lists_top16(lists, nvp, 2, 1))


def fused_decode_chain(plans, comms, p, seq_lens, dql, slot, tagged, pools, outputs, nvp):
    """Every rank's fused score and publish, then every owner's merge (one stream)."""
    world = len(plans)
    for r, plan in enumerate(plans):
        msa_icp.msa_icp_decode_score_publish(
            p["q_cuda"], p["shards_cuda"][r], p["table_cuda"], seq_lens, nvp, pools[r],
            comms[r].tagged_bases if tagged else comms[r].legacy_bases, comms[r].errors,
            rank=r, world_size=world, page_size=plan.page_size, decode_query_len=dql,
            slot=slot, capacity=comms[r].capacity, force_begin_blocks=plan.init_blocks,
            force_end_blocks=plan.local_blocks,
            generations=comms[r].generations if tagged else None,
        )  # fmt: skip
    merge_all(plans, comms, slot, tagged, outputs, nvp)


def decode_pools(plans, tokens):
    size = msa_icp.msa_icp_decode_pool_bytes(max_decode_tokens=tokens)
    return [torch.full((size,), 0x7F, dtype=torch.uint8, device="cuda") for _ in plans]


@pytest.mark.parametrize("world, page", [(2, 128), (4, 128), (2, 256), (4, 256)])
@pytest.mark.parametrize("tagged", [False, True])
@pytest.mark.parametrize("lengths", [[1, 300, 5000, 20000], [3000] * 80])  # 4 runs; 1 to 3
def test_fused_decode_chain_reproduces_the_unsharded_top16(world, page, tagged, lengths):
    dql = 2 if len(lengths) < 10 else 1
    p, plans, comms, scores, outputs, seq_lens, nvp = decode_setup(
        world, page, dql, lengths, seed=page + 1
    )
    pools = decode_pools(plans, dql * len(lengths))
    for slot in range(3):
        decode_chain(plans, comms, p, seq_lens, dql, slot, tagged, scores, outputs, nvp)
        chain = torch.cat([o.cpu() for o in outputs], dim=1)
        assert torch.equal(chain, decode_want(p, plans, scores, seq_lens, dql, nvp))
        for out in outputs:
            out.fill_(-7)
        fused_decode_chain(plans, comms, p, seq_lens, dql, slot, tagged, pools, outputs, nvp)
        assert torch.equal(torch.cat([o.cpu() for o in outputs], dim=1), chain)
    assert all(c.errors.item() == 0 for c in comms)


def test_plan_decode_with_a_pool_on_a_stream_a_rank():
    """Each simulated rank's plan.decode(pool=...) on its own stream (a rank's merge waits
    for the others' publishes, as across GPUs)."""
    world, page, dql = 2, 128, 1
    lengths = [700, 3000, 9000]
    p, plans, comms, scores, outputs, seq_lens, nvp = decode_setup(
        world, page, dql, lengths, seed=4
    )
    decode_chain(plans, comms, p, seq_lens, dql, 0, False, scores, outputs, nvp)
    chain = torch.cat([o.clone() for o in outputs], dim=1)
    pools = decode_pools(plans, dql * len(lengths))
    for out in outputs:
        out.fill_(-7)
    streams = [torch.cuda.Stream() for _ in plans]
    for r, plan in enumerate(plans):
        streams[r].wait_stream(torch.cuda.current_stream())  # the poisoned outputs first
        with torch.cuda.stream(streams[r]):
            plan.decode(
                p["q_cuda"], p["shards_cuda"][r], p["table_cuda"], seq_lens, nvp, None,
                outputs[r], comm=comms[r], slot=1, tagged=False, decode_query_len=dql,
                pool=pools[r],
            )  # fmt: skip
    torch.cuda.synchronize()
    assert torch.equal(torch.cat(outputs, dim=1), chain)
    assert all(c.errors.item() == 0 for c in comms)


@pytest.mark.parametrize("fused", [False, True])
def test_decode_chain_replays_in_a_cuda_graph(fused):
    world, page, dql = 2, 128, 1
    lengths = [700, 3000]
    p, plans, comms, scores, outputs, seq_lens, nvp = decode_setup(
        world, page, dql, lengths, seed=9
    )
    pools = decode_pools(plans, dql * len(lengths))

    def chain(slot):
        if fused:
            fused_decode_chain(plans, comms, p, seq_lens, dql, slot, False, pools, outputs, nvp)
        else:
            decode_chain(plans, comms, p, seq_lens, dql, slot, False, scores, outputs, nvp)

    eager = []
    for slot in range(3):
        chain(slot)
        eager.append(torch.cat([o.clone() for o in outputs], dim=1))
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for slot in range(3):
            chain(slot)
    for o in outputs:
        o.fill_(-7)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(torch.cat(outputs, dim=1), eager[2])
    assert all(c.errors.item() == 0 for c in comms)
