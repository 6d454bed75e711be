"""The NVFP4 reference (the fp32 oracle of the MSA packed K/V pages) on the CPU: E2M1 rounding
to nearest even with saturation, scales clamped before the e4m3 cast, nibble order, the V-scale
swizzle, the page layout of the contract (regions, offsets, strides), and writes and reads
of single tokens' slots."""

import pytest
import torch
from sparseforge import reference as ref


def test_e2m1_codes_round_to_nearest_even_and_saturate():
    x = torch.tensor([0.0, 0.5, 6.0, -1.5, 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 7.0, 100.0, -0.2])
    codes = ref.e2m1_encode(x)
    # 0.25 -> 0 (code 0), 0.75 -> 1 (code 2), 1.25 -> 1 (2), 1.75 -> 2 (4), 2.5 -> 2 (4),
    # 3.5 -> 4 (6), 5 -> 4 (6); 7 and 100 saturate to 6 (7); -0.2 -> -0 (8).
    assert codes.tolist() == [0, 1, 7, 11, 0, 2, 2, 4, 4, 6, 6, 7, 7, 8]
    assert ref.e2m1_decode(codes).tolist() == [
        0.0, 0.5, 6.0, -1.5, 0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0, 6.0, 6.0, -0.0,
    ]  # fmt: skip


def test_quantize_is_exact_on_representable_values_and_close_elsewhere():
    gen = torch.Generator().manual_seed(0)
    g = 0.01
    codes = torch.randint(0, 16, (4, 128), generator=gen).to(torch.uint8)
    codes[:, ::16] = 7  # amax of each group = 6 x scale x g
    scales = torch.tensor([0.5, 1.0, 2.0, 448.0]).repeat_interleave(8).view(4, 8)
    x = ref.nvfp4_dequantize(codes, scales.to(torch.float8_e4m3fn), g)
    got_codes, got_scales = ref.nvfp4_quantize(x, g)
    assert torch.equal(ref.nvfp4_dequantize(got_codes, got_scales, g), x)
    y = torch.randn(64, 128, generator=gen)
    back = ref.nvfp4_dequantize(*ref.nvfp4_quantize(y, 0.001), 0.001)
    assert float((back - y).norm() / y.norm()) < 0.12  # e2m1 keeps about 3 bits
    zeros = ref.nvfp4_quantize(torch.zeros(2, 32), 1.0)
    assert torch.all(zeros[0] == 0) and torch.all(zeros[1].float() == 0)


def test_scales_clamp_to_448_before_the_cast():
    x = torch.full((1, 16), 1e6)
    _, scales = ref.nvfp4_quantize(x, 1.0)
    assert scales.float().item() == 448.0


def test_nibbles_and_swizzle():
    codes = torch.arange(16, dtype=torch.uint8).repeat(2)
    packed = ref.pack_e2m1(codes)
    assert packed[0].item() == 0x10 and packed[1].item() == 0x32  # even element low
    assert torch.equal(ref.unpack_e2m1(packed), codes)
    logical = torch.arange(128 * 8).view(128, 8)
    stored = ref.swizzle_v_scales(logical)
    assert stored[5, 5] == logical[5, 3]  # (t 5, s 3) -> ((5 // 4) * 4 + 1, 4 + 1)
    assert torch.equal(stored.flatten().sort().values, logical.flatten())
    assert torch.equal(ref.unswizzle_v_scales(stored), logical)


def test_page_layout_and_round_trip():
    hkv, pages = 4, 3
    page_bytes = hkv * ref.NVFP4_PAGE_BYTES_PER_HEAD
    assert page_bytes == 73728
    buffer = torch.zeros(pages, page_bytes, dtype=torch.uint8)
    views = ref.nvfp4_page_views(buffer, hkv)
    assert views["k_data"].stride() == (page_bytes, 8192, 64, 1)
    assert views["v_scales"].stride() == (page_bytes, 1024, 8, 1)
    for i, name in enumerate(("k_data", "k_scales", "v_data", "v_scales")):
        views[name].fill_(i + 1)
    assert torch.all(buffer > 0)  # the four regions tile the page
    assert [int(buffer[0, hkv * o]) for o in ref.NVFP4_REGIONS.values()] == [1, 2, 3, 4]
    gen = torch.Generator().manual_seed(1)
    k = torch.randn(pages, hkv, 128, 128, generator=gen)
    v = torch.randn(pages, hkv, 128, 128, generator=gen)
    packed = ref.nvfp4_pack_pages(k, v, 0.002, 0.003)
    k_back, v_back = ref.nvfp4_unpack_pages(packed, hkv, 0.002, 0.003)
    assert torch.equal(k_back, ref.nvfp4_dequantize(*ref.nvfp4_quantize(k, 0.002), 0.002))
    assert torch.equal(v_back, ref.nvfp4_dequantize(*ref.nvfp4_quantize(v, 0.003), 0.003))


def tokens(x):
    """(pages, Hkv, 128, D) -> (pages * 128, Hkv, D): rows in slot order."""
    return x.permute(0, 2, 1, 3).flatten(0, 1)


def test_slot_writes_match_whole_pages_and_read_back():
    """nvfp4_write_slots of every token in a shuffled order gives nvfp4_pack_pages' bytes;
    a partial write leaves the other tokens alone, skips negative slots and reads back as
    the dequantized quantization."""
    gen = torch.Generator().manual_seed(3)
    pages, hkv = 3, 2
    k, v = (torch.randn(pages, hkv, 128, 128, generator=gen) * 5 for _ in "kv")
    whole = ref.nvfp4_pack_pages(k, v, 0.002, 0.003)
    order = torch.randperm(pages * 128, generator=gen)
    written = torch.zeros_like(whole)
    ref.nvfp4_write_slots(written, tokens(k)[order], tokens(v)[order], order, hkv, 0.002, 0.003)
    assert torch.equal(written, whole)

    before = written.clone()
    new_k, new_v = (torch.randn(4, hkv, 128, generator=gen) for _ in "kv")
    slots = torch.tensor([5, -1, 200, 383])
    ref.nvfp4_write_slots(written, new_k, new_v, slots, hkv, 0.002, 0.003)
    k_back, v_back = ref.nvfp4_read_slots(written, slots[slots >= 0], hkv, 0.002, 0.003)
    keep = slots >= 0
    assert torch.equal(k_back, ref.nvfp4_dequantize(*ref.nvfp4_quantize(new_k[keep], 0.002), 0.002))
    assert torch.equal(v_back, ref.nvfp4_dequantize(*ref.nvfp4_quantize(new_v[keep], 0.003), 0.003))
    untouched = torch.ones(pages * 128, dtype=torch.bool)
    untouched[slots[keep]] = False
    old = ref.nvfp4_read_slots(before, torch.arange(pages * 128)[untouched], hkv, 0.002, 0.003)
    now = ref.nvfp4_read_slots(written, torch.arange(pages * 128)[untouched], hkv, 0.002, 0.003)
    assert all(torch.equal(a, b) for a, b in zip(old, now, strict=True))


# --- quantize_write_kv_nvfp4's argument checks (CPU: each comes before the device's) -------


def write_args(**changes):
    from sparseforge.check import nvfp4_write_inputs

    args = nvfp4_write_inputs(torch.bfloat16, 2, tokens=10, pages=1)
    args.update(changes)
    return args


@pytest.mark.parametrize(
    "changes, words",
    [
        (dict(k=torch.zeros(10, 2, 128)), "k must be bf16 or fp16"),
        (dict(v=torch.zeros(10, 2, 128, dtype=torch.float16)), "v must match k"),
        (
            dict(
                k=torch.zeros(10, 2, 64, dtype=torch.bfloat16),
                v=torch.zeros(10, 2, 64, dtype=torch.bfloat16),
            ),
            "k must be (T, Hkv, 128)",
        ),
        (
            dict(slots=torch.zeros(10, dtype=torch.int64)),
            "slots must be a contiguous int32 vector of length 10",
        ),
        (
            dict(pages=torch.zeros(1, 18432, dtype=torch.uint8)),
            "pages must be uint8 (pages, Hkv * 18432 = 36864)",
        ),
        (dict(k_global_scale=0.0), "k_global_scale must be a positive finite number"),
        (dict(v_global_scale=float("inf")), "v_global_scale must be a positive finite number"),
        (dict(), "quantize_write_kv_nvfp4 needs a CUDA device"),
    ],
)
def test_write_arguments_are_checked_by_name(changes, words):
    from sparseforge.msa_ops import quantize_write_kv_nvfp4

    with pytest.raises(ValueError) as info:
        quantize_write_kv_nvfp4(**write_args(**changes))
    assert words in str(info.value), str(info.value)


def test_write_refuses_pages_that_overlap_its_inputs():
    from sparseforge.msa_ops import quantize_write_kv_nvfp4

    args = write_args()
    args["slots"] = args["pages"].view(torch.int32)[0, :10]
    with pytest.raises(ValueError, match="the memory pages spans overlaps slots'"):
        quantize_write_kv_nvfp4(**args)


def test_e2m1_word_pairs_bit_placement_reads_as_values_over_2_14():
    """The E2M1 decoding of the MSA and SDSA kernels (e2m1_high_bytes, e2m1_word_pairs,
    e2m1_word_as_fp16), mirrored on integers: the high bytes built from a word's even and odd
    codes, permuted or masked into fp16 pairs, are the codes' values / 2^14 for every code in
    every position, signed zeros included."""
    g = torch.Generator().manual_seed(0)
    words = torch.randint(0, 2**32, (4096,), generator=g, dtype=torch.int64)
    words[:16] = torch.arange(16) * 0x11111111  # every code in every position
    even = ((words << 1) & 0x0E0E0E0E) | ((words << 4) & 0x80808080)
    odd = ((words >> 3) & 0x0E0E0E0E) | (words & 0x80808080)

    def high_bytes_of(x, first, second):  # prmt(x, 0, 0x2404) for bytes (0, 2)
        return (((x >> 8 * first) & 0xFF) << 8) | (((x >> 8 * second) & 0xFF) << 24)

    # e2m1_word_pairs: pair k = codes k, k + 4; e2m1_word_as_fp16: pair b = codes 2b, 2b + 1
    # (prmt(even, odd, ...) & 0xFF00FF00: even byte b into byte 1, odd byte b into byte 3).
    pairs = [high_bytes_of(even, 0, 2), high_bytes_of(odd, 0, 2), even & 0xFF00FF00,
             odd & 0xFF00FF00]  # fmt: skip
    in_order = [(((even >> 8 * b) & 0xFF) << 8) | (((odd >> 8 * b) & 0xFF) << 24) for b in range(4)]
    checks = [(pair, (k, k + 4)) for k, pair in enumerate(pairs)]
    checks += [(pair, (2 * b, 2 * b + 1)) for b, pair in enumerate(in_order)]
    for k, (pair, code_indices) in enumerate(checks):
        for half, code_index in enumerate(code_indices):
            bits = ((pair >> 16 * half) & 0xFFFF).to(torch.int16)
            got = bits.view(torch.float16).float()
            codes = ((words >> 4 * code_index) & 0xF).to(torch.uint8)
            want = ref.e2m1_decode(codes) / 2**14
            assert torch.equal(got, want), (k, half)
            assert torch.equal(got.signbit(), want.signbit()), (k, half)


def test_e2m1_times_scale_over_2_7_is_exact_in_fp16():
    """decode_chunks' fp16 route (FP16_DIVISOR_LOG2 = 7): a code's fp16 value / 2^14 times its
    scale x 2^7 (one fp16 multiply) equals value x scale / 2^7 exactly, for all 16 codes and
    every finite e4m3 scale, subnormal scales included (the products lie in [2^-17, 21] with at
    most 6 significant bits)."""
    codes = torch.arange(16, dtype=torch.uint8)
    values = ref.e2m1_decode(codes).double()
    scale_bytes = torch.arange(256, dtype=torch.uint8)
    scales = scale_bytes.view(torch.float8_e4m3fn).double()
    scales = scales[scales.isfinite() & (scales >= 0)]
    operand = (values / 2**14).half()  # the placed bits, exact
    multiplier = (scales * 2**7).half()  # scale x 2^7 <= 57344, exact
    assert torch.equal(operand.double(), values / 2**14)
    assert torch.equal(multiplier.double(), scales * 2**7)
    product = operand[:, None] * multiplier[None, :]  # an fp16 multiply, rounded to fp16
    want = values[:, None] * scales[None, :] / 2**7
    assert torch.equal(product.double(), want)
