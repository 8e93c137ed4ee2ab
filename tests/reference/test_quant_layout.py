"""Byte layouts (docs/semantics.md §2.2, §2.3) and the FP8 quantisers: exact page sizes, field positions,
power-of-two scales, round-trip error bounds."""

import pytest
import torch

from dsv4_compile import layout
from dsv4_compile.reference import kv_store, quant


def test_page_bytes_match_spec():
    assert layout.TOKEN_BYTES == 584
    assert layout.model1_page_bytes(256) == 149760
    assert layout.model1_page_bytes(64) == 37440
    assert layout.model1_page_bytes(2) == 1728
    assert layout.index_page_bytes(64) == 8448


def test_model1_scales_are_powers_of_two_covering_the_tile():
    k = (torch.randn(50, 512) * torch.logspace(-3, 3, 50).unsqueeze(1)).bfloat16()
    data, scales = quant.quantize_model1(k)
    assert data.shape == (50, 576) and scales.shape == (50, 8)
    assert torch.all(scales[:, 7] == 0)  # pad byte
    exponent = scales[:, :7].float() - 127
    amax = k[:, :448].float().abs().reshape(50, 7, 64).amax(-1)
    # s = 2^ceil(log2(amax / 448)): the smallest power of two with amax / s <= 448
    assert torch.all(amax / torch.exp2(exponent) <= 448)
    assert torch.all(amax / torch.exp2(exponent - 1) > 448)


def test_model1_round_trip():
    k = torch.randn(64, 512).bfloat16()
    back = quant.dequantize_model1(*quant.quantize_model1(k))
    assert torch.equal(back[:, 448:], k[:, 448:].float())  # rope kept exactly in bf16
    nope_err = (back[:, :448] - k[:, :448].float()).abs()
    tile_amax = k[:, :448].float().abs().reshape(64, 7, 64).amax(-1, keepdim=True).expand(64, 7, 64)
    # e4m3 has 3 mantissa bits: relative step 2^-3 at the top of a binade, half of it after rounding
    assert torch.all(nope_err <= tile_amax.reshape(64, 448) * 2 ** -4 + 1e-12)
    # dequantised values are exactly representable in bf16, so fake_quant is lossless beyond fp8
    assert torch.equal(quant.fake_quant_model1(k).float(), back)


def test_model1_zero_tile_uses_eps_floor():
    k = torch.zeros(1, 512, dtype=torch.bfloat16)
    _, scales = quant.quantize_model1(k)
    assert torch.all(scales[0, :7] == 127 + quant.ceil_log2(torch.tensor([1e-4 / 448])).item())
    assert torch.equal(quant.dequantize_model1(*quant.quantize_model1(k)), torch.zeros(1, 512))


@pytest.mark.parametrize("page_size", [256, 64, 2])
def test_model1_token_lands_at_documented_offsets(page_size):
    pages = 3
    cache = torch.zeros(pages, layout.model1_page_bytes(page_size), dtype=torch.uint8)
    k = torch.randn(1, 512).bfloat16()
    slot = 2 * page_size + page_size - 1  # last token of page 2
    kv_store.store_model1(cache, torch.tensor([slot]), k, page_size)
    data, scales = quant.quantize_model1(k)
    off = layout.model1_offsets(page_size, page_size - 1)
    page = cache[2]
    assert torch.equal(page[off.nope:off.nope + 448], data[0, :448])
    assert torch.equal(page[off.rope:off.rope + 128].view(torch.bfloat16), k[0, 448:])
    assert torch.equal(page[off.scales:off.scales + 8], scales[0])
    assert int(cache.count_nonzero()) == int(data.count_nonzero()) + int(scales.count_nonzero())
    assert cache[:2].count_nonzero() == 0


def test_index_key_zero_row_uses_eps_floor():
    """An all-zero indexer key gets the scale floor 1e-4 / 448 (no 0 / 0) and reads back as zeros."""
    vals, scale = quant.quantize_index_k(torch.zeros(2, 128))
    assert torch.equal(scale, torch.full((2,), 1e-4) / 448)
    assert torch.all(vals == 0)
    assert torch.equal(quant.dequantize_index_k(vals, scale), torch.zeros(2, 128))


def test_index_key_round_trip_and_layout():
    k = torch.randn(5, 128) * 3
    vals, scale = quant.quantize_index_k(k)
    assert torch.allclose(scale, k.abs().amax(1) / 448)
    back = quant.dequantize_index_k(vals, scale)
    assert torch.all((back - k).abs() <= scale.unsqueeze(1) * 16 + 1e-6)  # half an e4m3 step at 448
    cache = torch.zeros(2, layout.index_page_bytes(), dtype=torch.uint8)
    kv_store.store_index_k(cache, torch.tensor([64 + 3]), k[:1], 64)
    assert torch.equal(cache[1, 3 * 128:4 * 128], vals[0])
    assert torch.equal(cache[1, 8192 + 12:8192 + 16].view(torch.float32), scale[:1])


def test_negative_slots_are_skipped_and_read_as_zero():
    page_size = 64
    cache = torch.randint(0, 255, (4, layout.model1_page_bytes(page_size)), dtype=torch.uint8)
    before = cache.clone()
    k = torch.randn(3, 512).bfloat16()
    kv_store.store_model1(cache, torch.tensor([-1, 130, -5]), k, page_size)
    data, scales = quant.quantize_model1(k[1:2])
    d_view, s_view = quant.model1_page_views(cache, page_size)
    assert torch.equal(d_view[2, 2], data[0]) and torch.equal(s_view[2, 2], scales[0])
    d_view[2, 2], s_view[2, 2] = quant.model1_page_views(before, page_size)[0][2, 2], \
        quant.model1_page_views(before, page_size)[1][2, 2]
    assert torch.equal(cache, before)  # nothing else changed, the dummy slot included
    got = kv_store.gather_model1(cache, torch.tensor([[-1, 3]]), page_size)
    assert got.shape == (1, 2, 512) and torch.all(got[0, 0] == 0)


@pytest.mark.parametrize("gather, store, width, page_size", [
    (kv_store.gather_model1, kv_store.store_model1, 512, 64),
    (kv_store.gather_index_k, kv_store.store_index_k, 128, layout.INDEX_PAGE_SIZE),
])
def test_gather_reads_each_slot_as_a_lone_read_does(gather, store, width, page_size):
    """On the CPU a gather dequantises each distinct slot once and copies the rows out: every row
    of a batch with repeated, invalid and out-of-range slots equals that slot read on its own."""
    pages = 3
    page_bytes = layout.model1_page_bytes(page_size) if width == 512 else layout.index_page_bytes(page_size)
    cache = torch.zeros(pages, page_bytes, dtype=torch.uint8)
    slots_written = torch.arange(1, pages * page_size)
    store(cache, slots_written, torch.randn(slots_written.shape[0], width).bfloat16() * 3, page_size)
    gen = torch.Generator().manual_seed(0)
    slots = torch.randint(-4, pages * page_size + 4, (5, 40), generator=gen)
    slots[:, ::7] = slots[0, 3]  # repeats across and within rows
    got = gather(cache, slots, page_size)
    assert got.shape == (5, 40, width)
    for (r, c), slot in zip(torch.cartesian_prod(torch.arange(5), torch.arange(40)).tolist(), slots.flatten()):
        assert torch.equal(got[r, c], gather(cache, slot.view(1), page_size)[0]), (r, c, int(slot))
