"""token_sparse on the CPU: the references against a plain Python reading of the contract,
and every argument error before launch."""

import pytest
import torch
from sparseforge import reference
from sparseforge.check import group_union_inputs, token_sparse_kv_inputs
from sparseforge.token_sparse import group_union_masks, token_sparse_kv_indices

I32 = dict(dtype=torch.int32)


@pytest.mark.parametrize("rpt", [1, 2, 4])
def test_kv_indices_reference_reads_the_contract(rpt):
    args = token_sparse_kv_inputs(rpt=rpt)
    got_tables, got_lens = reference.token_sparse_kv_indices(
        args["positions"],
        args["requests"],
        args["block_table"],
        block_tables=args["block_tables"].clone(),
        seq_lens=args["seq_lens"].clone(),
        requests_per_token=rpt,
    )
    t, k = args["positions"].shape
    for token in range(t):
        row_of_table = int(args["requests"][token])
        want = [
            int(args["block_table"][row_of_table, p // 64]) * 64 + p % 64 if p >= 0 else -1
            for p in args["positions"][token].tolist()
        ]
        for j in range(rpt):
            row = token * rpt + j
            assert got_tables[row, 0].tolist() == want and got_tables[row, 1].tolist() == want
            assert int(got_lens[row]) == sum(p >= 0 for p in args["positions"][token].tolist())
    assert torch.all(got_tables[t * rpt :] == -7) and torch.all(got_lens[t * rpt :] == -7)


def test_group_union_reference_reads_the_contract():
    a = group_union_inputs()
    union, sizes, mask = reference.group_union_masks(
        **{**a, **{name: a[name].clone() for name in ("union", "union_sizes", "mask")}}
    )
    groups, t = a["requests"].shape[0], a["positions"].shape[0]
    n = t // groups
    written_unions, written_masks = set(), set()
    for g in range(groups):
        rows = range(g * n, (g + 1) * n)
        selected = [{p for p in a["positions"][i].tolist() if 0 <= p < a["num_keys"]} for i in rows]
        keys = sorted(set().union(*selected))
        table_row = int(a["requests"][g])
        slots = [int(a["block_table"][table_row, p // 64]) * 64 + p % 64 for p in keys]
        b = int(a["group_unions"][g])
        if b >= 0:
            written_unions.add(b)
            assert int(sizes[b]) == len(keys) and union[b, : len(keys)].tolist() == slots
            assert torch.all(union[b, len(keys) :] == -7)
        words = 4 * -(-len(keys) // 128)
        for i, chosen in zip(rows, selected, strict=True):
            row = int(a["query_rows"][i])
            if row < 0:
                continue
            written_masks.add(row)
            got = {
                32 * w + j
                for w, word in enumerate(mask[row, :words].tolist())
                for j in range(32)
                if (word >> j) & 1
            }
            assert got == {keys.index(p) for p in chosen}
            assert torch.all(mask[row, words:] == -7)
    for b in set(range(union.shape[0])) - written_unions:
        assert torch.all(union[b] == -7) and int(sizes[b]) == -7
    for row in set(range(mask.shape[0])) - written_masks:
        assert torch.all(mask[row] == -7)


def test_pack_bits_uses_the_sign_bit():
    bits = torch.zeros(64, dtype=torch.bool)
    bits[[0, 31, 33]] = True
    assert reference.pack_bits(bits).tolist() == [1 - 2**31, 2]


SHARED = torch.zeros(32, **I32)  # requests and, in one case, seq_lens in the same memory
SHARED_UNION = torch.zeros(12, **I32)  # query_rows and, in one case, union_sizes


def kv_call(**change):
    args = token_sparse_kv_inputs()
    if "seq_lens" in change:
        args["requests"] = SHARED[:7]
    args.update(change)
    return token_sparse_kv_indices(
        args.pop("positions"), args.pop("requests"), args.pop("block_table"), **args
    )


@pytest.mark.parametrize(
    "change, message",
    [
        (dict(positions=torch.zeros(5, 500, **I32)), "K must be a positive multiple of 512"),
        (dict(positions=torch.zeros(5, 512)), "positions has dtype torch.float32"),
        (dict(requests=torch.zeros(4, **I32)), "requests has 4 entries, fewer than the 5"),
        (dict(requests=torch.zeros(14, **I32)[::2]), "requests must be contiguous"),
        (dict(block_table=torch.zeros(3, 0, **I32)), "block_table has shape (3, 0): it is empty"),
        (dict(block_tables=torch.zeros(9, 2, 512, **I32)), "expected (>= 10, 2, 512)"),
        (dict(block_tables=torch.zeros(10, 1, 512, **I32)), "expected (>= 10, 2, 512)"),
        (dict(seq_lens=torch.zeros(9, **I32)), "seq_lens has 9 entries, fewer than the 10 rows"),
        (dict(requests_per_token=0), "requests_per_token must be a positive int"),
        (dict(seq_lens=SHARED[:13]), "the memory seq_lens spans overlaps requests's"),
        (dict(), "token_sparse kernels need a CUDA device"),
    ],
)
def test_kv_indices_errors(change, message):
    with pytest.raises(ValueError) as info:
        kv_call(**change)
    assert message in str(info.value)


def union_call(**change):
    args = group_union_inputs()
    if "union_sizes" in change:
        args["query_rows"] = SHARED_UNION
    args.update(change)
    return group_union_masks(
        *(args.pop(n) for n in ("positions", "query_rows", "group_unions", "requests")),
        args.pop("block_table"),
        **args,
    )


@pytest.mark.parametrize(
    "change, message",
    [
        (dict(requests=torch.zeros(5, **I32)), "not a whole number of groups of the 5 requests"),
        (dict(query_rows=torch.zeros(11, **I32)), "query_rows has 11 entries, expected 12"),
        (dict(group_unions=torch.zeros(2, **I32)), "group_unions has 2 entries, expected 3"),
        (dict(num_keys=0), "num_keys must be a positive int"),
        (dict(num_keys=64 * 49 + 1), "exceeds the block table's 49 pages of 64 keys"),
        (
            dict(num_keys=262145, block_table=torch.zeros(1, 5000, **I32)),
            "num_keys 262145 exceeds 262144",
        ),
        # min(n K, 128 ceil(num_keys / 128)) = min(2048, 3072)
        (dict(union=torch.zeros(5, 2047, **I32)), "union rows hold 2047 columns; at least 2048"),
        (dict(mask=torch.zeros(16, 63, **I32)), "at least 64 words needed"),
        (dict(mask=torch.zeros(16, 64, 1, **I32)), "mask has 3 dimensions"),
        (dict(union_sizes=SHARED_UNION[:5]), "union_sizes spans overlaps query_rows's"),
        (dict(), "token_sparse kernels need a CUDA device"),
    ],
)
def test_group_union_errors(change, message):
    with pytest.raises(ValueError) as info:
        union_call(**change)
    assert message in str(info.value)
