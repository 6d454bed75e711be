"""The ICP indexer's chains across real GPUs: `torchrun --nproc_per_node W tests/icp_torchrun.py
[--steps N]` (W = 2 or 4, one GPU a rank, NCCL). Every rank builds the same sharded problem
(sparseforge.check.icp_sharded_problem), keeps its shard and:

- prefill: scores its shard, selects its carrier rows, exchanges them with NCCL's
  all_to_all (rows by head owner), merges its heads; the ids are gathered and compared with
  the top-16 of the global block maxima (reference_icp.top16_of_maxima over every rank's
  gathered scores); the fused msa_icp_prefill_score_select's carrier rows equal the chain's;
- decode: the plan's decode chain (score plane, publish into the owners' receive rows in
  PyTorch symmetric memory, merge) in legacy and tagged rows, checked the same way; then the
  plan's fused decode (pool=...), whose ids must equal the chain's;
- soak: N decode steps (default 10,000) of publish and merge only, rank r's one candidate a
  step, every owner checking each step's ids on the GPU (a lost or stale row shows an old
  step's); the error counters stay 0.

Prints one line per check and "ICP torchrun: OK" on rank 0 when all pass; exit status 1 if
any fails.
"""

import argparse
import math
import os
import sys

import torch
import torch.distributed as dist
from sparseforge import msa_icp, reference_icp
from sparseforge.check import icp_sharded_problem
from sparseforge.msa_icp import MSAIcpComm

HEADS, TOPK, WORDS = 4, 16, 33


def gathered(t: torch.Tensor, world: int) -> list:
    parts = [torch.empty_like(t) for _ in range(world)]
    dist.all_gather(parts, t.contiguous())
    return [p.cpu() for p in parts]


def global_top16(planes, ids_of, blocks, nvp, fb, fe):
    t = planes[0].shape[0]
    maxima = torch.full((t, HEADS, blocks), -math.inf)
    for plane, ids in zip(planes, ids_of, strict=True):
        keep = ids < blocks
        maxima[..., ids[keep]] = torch.maximum(maxima[..., ids[keep]], plane[..., keep])
    return reference_icp.top16_of_maxima(maxima, nvp, fb, fe)


def column_ids(page, rank, world, width):
    scale, offset = (1, 0) if page == 128 else (2, 2 * rank // world)
    return torch.arange(width) * scale + offset


def check_prefill(rank, world, page, device) -> bool:
    keys, queries = [3000, 9000], [64, 100]
    p = icp_sharded_problem(keys, queries, world, page, seed=page)
    seqs = p["seqs"]
    plan = msa_icp.msa_icp_index_score_sharded_plan(
        torch.tensor(queries, dtype=torch.int32), torch.tensor(keys, dtype=torch.int32), 4,
        qo_offset=torch.tensor([s["offset"] for s in seqs], dtype=torch.int32), device=device,
    )  # fmt: skip
    q = torch.cat([s["q"] for s in seqs]).to(device)
    tokens = q.shape[0]
    width = msa_icp.msa_icp_index_score_columns(max(keys), page)
    scores = torch.empty(tokens, HEADS, width, device=device)
    msa_icp.msa_icp_index_score_sharded(
        q, p["shards"][rank].to(device), p["table"].to(device), plan, rank=rank,
        max_score=scores, tp=world, compact=True,
    )  # fmt: skip
    nvp = torch.cat([s["positions"] // 128 + 1 for s in seqs]).int()
    carrier = torch.empty(HEADS, tokens, WORDS, dtype=torch.int32, device=device)
    scale, offset = (1, 0) if page == 128 else (2, 2 * rank // world)
    msa_icp.msa_icp_topk_select_prefill(
        scores, nvp.to(device), carrier, force_begin_blocks=1, force_end_blocks=2,
        index_scale=scale, index_offset=offset,
    )  # fmt: skip
    received = torch.empty(world, HEADS // world, tokens, WORDS, dtype=torch.int32, device=device)
    dist.all_to_all_single(received.view(-1), carrier.view(-1))
    out = torch.empty(tokens, HEADS // world, TOPK, dtype=torch.int32, device=device)
    errors = torch.zeros(1, dtype=torch.int32, device=device)
    msa_icp.msa_icp_merge_candidates(
        received, nvp.to(device), out, errors, init_blocks=1, local_blocks=2, prefill=True
    )
    got = torch.cat(gathered(out, world), dim=1)
    planes = gathered(scores, world)
    ids_of = [column_ids(page, r, world, width) for r in range(world)]
    want = global_top16(planes, ids_of, -(-max(keys) // 128), nvp, 1, 2)
    # The fused path writes the same carrier rows.
    pool = torch.empty(
        msa_icp.msa_icp_prefill_pool_bytes(total_q=tokens, batch=2, device=device),
        dtype=torch.uint8, device=device,
    )  # fmt: skip
    fused = torch.empty_like(carrier)
    msa_icp.msa_icp_prefill_score_select(
        q, p["shards"][rank].to(device), p["table"].to(device), plan, nvp.to(device), pool,
        fused, rank=rank, tp=world, compact=True, force_begin_blocks=1, force_end_blocks=2,
    )  # fmt: skip
    same = torch.equal(fused, carrier)
    return torch.equal(got, want) and same and errors.item() == 0


def check_decode(rank, world, page, device, tagged: bool) -> bool:
    lengths, dql = [1, 700, 6000, 40000], 2
    p = icp_sharded_problem(lengths, [dql] * len(lengths), world, page, seed=7)
    plan = msa_icp.prepare_msa_icp_indexer(
        world_size=world, rank=rank, num_index_heads=4, page_size=page, init_blocks=1,
        local_blocks=2, max_decode_tokens=64, max_decode_query_len=8,
        max_num_batched_tokens=8192, max_num_seqs=64, max_model_len=max(lengths),
        num_sparse_layers=4, device=device,
    )  # fmt: skip
    plan.warmup()
    tokens = dql * len(lengths)
    comm = MSAIcpComm.from_process_group(dist.group.WORLD, tokens, device)
    q = torch.cat([s["q"] for s in p["seqs"]]).to(device)
    seq_lens = torch.tensor(lengths, dtype=torch.int32, device=device)
    nvp = torch.tensor([-(-n // 128) for n in lengths]).repeat_interleave(dql).int()
    scores = torch.full((tokens, HEADS, plan.decode_score_columns), -math.inf, device=device)
    out = torch.empty(tokens, HEADS // world, TOPK, dtype=torch.int32, device=device)
    pool = torch.empty(
        msa_icp.msa_icp_decode_pool_bytes(max_decode_tokens=tokens), dtype=torch.uint8,
        device=device,
    )  # fmt: skip
    ok, chain = True, []
    for fused in (False, True):
        for slot in range(3):
            out.fill_(-7)
            plan.decode(
                q, p["shards"][rank].to(device), p["table"].to(device), seq_lens,
                nvp.to(device), scores, out, comm=comm, slot=slot, tagged=tagged,
                decode_query_len=dql, pool=pool if fused else None,
            )  # fmt: skip
            got = torch.cat(gathered(out, world), dim=1)
            if fused:
                ok = ok and torch.equal(got, chain[slot])
                continue
            chain.append(got)
            planes = gathered(scores, world)
            ids_of = [column_ids(page, r, world, scores.shape[2]) for r in range(world)]
            want = global_top16(planes, ids_of, int(nvp.max()), nvp, 1, 2)
            ok = ok and torch.equal(got, want)
    return ok and comm.errors.item() == 0


def soak(rank, world, device, steps: int, tagged: bool) -> bool:
    tokens, cols = 8, 64
    comm = MSAIcpComm.from_process_group(dist.group.WORLD, tokens, device)
    nvp = torch.full((tokens,), cols, dtype=torch.int32, device=device)
    scores = torch.empty(tokens, HEADS, cols, device=device)
    out = torch.empty(tokens, HEADS // world, TOPK, dtype=torch.int32, device=device)
    bad = torch.zeros(1, dtype=torch.int32, device=device)
    for step in range(steps):
        slot, marker = step % 3, step % cols
        scores.fill_(-math.inf)
        scores[..., (marker + rank) % cols] = 1.0 + step
        msa_icp.msa_icp_topk_select_publish(
            scores, nvp, comm.tagged_bases if tagged else comm.legacy_bases, comm.errors,
            slot=slot, rank=rank, world_size=world, heads_per_rank=HEADS // world,
            capacity=tokens, force_begin_blocks=0, force_end_blocks=0,
            generations=comm.generations if tagged else None,
        )  # fmt: skip
        msa_icp.msa_icp_merge_candidates(
            comm.tagged[slot] if tagged else comm.legacy[slot], nvp, out, comm.errors,
            init_blocks=0, local_blocks=0,
            expected_generations=comm.expected[slot] if tagged else None,
        )  # fmt: skip
        best = sorted((marker + j) % cols for j in range(world))
        want = torch.tensor(best + [-1] * (TOPK - world), dtype=torch.int32, device=device)
        # No barrier: a rank's merge of step s waits for every peer's publish of s, which
        # each issues after its own merge of s - 1, so no rank runs more than a step ahead
        # and a slot set is reused three steps on (tagged rows need two).
        bad += (out != want).any().int()
    torch.cuda.synchronize(device)
    return bad.item() == 0 and comm.errors.item() == 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=10_000)
    args = parser.parse_args()
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", rank)))
    torch.cuda.set_device(device)
    dist.init_process_group("nccl", device_id=device)
    results = {}
    for page in (128, 256):
        results[f"prefill P{page}"] = check_prefill(rank, world, page, device)
        for tagged in (False, True):
            results[f"decode P{page} {'tagged' if tagged else 'legacy'}"] = check_decode(
                rank, world, page, device, tagged
            )
    for tagged in (False, True):
        results[f"soak {args.steps} steps {'tagged' if tagged else 'legacy'}"] = soak(
            rank, world, device, args.steps, tagged
        )
    verdicts = torch.tensor([all(results.values())], dtype=torch.int32, device=device)
    dist.all_reduce(verdicts, op=dist.ReduceOp.MIN)
    if rank == 0:
        for what, ok in results.items():
            print(f"W={world} {what}: {'ok' if ok else 'FAILED'}", flush=True)
        print("ICP torchrun: OK" if verdicts.item() else "ICP torchrun: FAILED", flush=True)
    dist.destroy_process_group()
    return 0 if verdicts.item() else 1


if __name__ == "__main__":
    sys.exit(main())
