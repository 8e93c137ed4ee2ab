"""The ``dsv4::rms_norm_rope`` kernel vs its reference (``ops/kernels/norm_rope.py``), small shapes.

Keys ``[T, D]`` and queries ``[T, H, D]``; weighted (fp32 and bf16 weights), unweighted, and the
unweighted norm with its scale rounded to bf16; a row length that is not a power of two; int32
and int64 positions far into the context; no tokens. The kernel sums the squares in another order
than the reference, and under the interpreter truncates where the GPU rounds to bf16, so each
value agrees to two bf16 steps at its own scale (the RoPE output rounds once more)."""

import pytest
import torch

from dsv4_compile import layout
from dsv4_compile.ops.kernels import kv_cache as kv_cache_kernels
from dsv4_compile.ops.kernels import norm_rope as kernels
from dsv4_compile.reference import functional as ref
from dsv4_compile.reference import kv_store
from dsv4_compile.testing import cache_inputs as inputs


def _close(got, want):
    torch.testing.assert_close(got.float(), want.float(), rtol=2 ** -6, atol=2 ** -6)


def _inputs(device, shape, weight, seed=0):
    gen = torch.Generator(device=device).manual_seed(seed)
    x = (3 * torch.randn(*shape, generator=gen, device=device)).bfloat16()
    w = None if weight is None else (torch.rand(shape[-1], generator=gen, device=device) + 0.5).to(weight)
    positions = torch.randint(0, 1 << 20, (shape[0],), generator=gen, device=device)
    inv_freq = 10000.0 ** (-torch.arange(0, 64, 2, device=device).float() / 64)
    return x, w, positions, inv_freq


@pytest.mark.parametrize("shape", [(5, 512), (4, 3, 512), (3, 2, 192)])
@pytest.mark.parametrize("weight, round_scale", [(None, False), (None, True), (torch.float32, False),
                                                 (torch.bfloat16, False)])
def test_kernel_matches_reference(device, shape, weight, round_scale):
    x, w, positions, inv_freq = _inputs(device, shape, weight)
    got = kernels.launch_rms_norm_rope(x, w, 1e-6, round_scale, positions, inv_freq)
    want = ref.rms_norm_rope(x, w, 1e-6, round_scale, positions, inv_freq)
    assert got.shape == x.shape and got.dtype == x.dtype
    _close(got, want)
    # the rotation moved the tail: the reference without RoPE differs there, equals before it
    plain = ref.rms_norm_rope(x, w, 1e-6, round_scale, torch.zeros_like(positions), inv_freq)
    _close(got[..., :-64], plain[..., :-64])
    assert not torch.allclose(got[..., -64:].float(), plain[..., -64:].float(), atol=0.1)


def test_int32_positions_and_no_tokens(device):
    x, _, positions, inv_freq = _inputs(device, (4, 2, 512), None, seed=1)
    wide = kernels.launch_rms_norm_rope(x, None, 1e-6, True, positions, inv_freq)
    assert torch.equal(kernels.launch_rms_norm_rope(x, None, 1e-6, True, positions.int(), inv_freq), wide)
    empty = kernels.launch_rms_norm_rope(x[:0], None, 1e-6, True, positions[:0], inv_freq)
    assert empty.shape == (0, 2, 512)


@pytest.mark.parametrize("slot_dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("weight, round_scale", [(None, True), (torch.float32, False), (torch.bfloat16, False)])
def test_store_variant_writes_what_the_two_kernels_write(device, weight, round_scale, slot_dtype):
    """The key's norm + RoPE + ``store_kv`` in one kernel against the norm + RoPE kernel followed by
    the ``store_kv`` kernel: only the written tokens change (two slots negative, one past the
    cache: skipped), their bytes equal but where the fused kernel's sum of squares, reduced over
    tiles, rounds a value one bf16 step apart, and the dequantised keys agree within FP8 steps."""
    page_size, num_pages = layout.SWA_PAGE_SIZE, 3
    x, w, positions, inv_freq = _inputs(device, (9, 512), weight, seed=2)
    gen = torch.Generator(device=device).manual_seed(2)
    slots = inputs.distinct_slots(9, num_pages, page_size, gen, dtype=slot_dtype, num_negative=2)
    slots[(slots >= 0).nonzero()[0]] = num_pages * page_size
    cache = torch.randint(0, 256, (num_pages, layout.model1_page_bytes(page_size)), generator=gen, device=device,
                          dtype=torch.uint8)
    fused, unfused = cache.clone(), cache.clone()
    kernels.launch_rms_norm_rope_store_kv(fused, slots, x, w, 1e-6, round_scale, positions, inv_freq, page_size)
    kv_cache_kernels.launch_store_kv(unfused, slots,
                                     kernels.launch_rms_norm_rope(x, w, 1e-6, round_scale, positions, inv_freq),
                                     page_size)
    stored = slots[(slots >= 0) & (slots < num_pages * page_size)]
    assert stored.numel() == 6
    written = torch.zeros_like(cache, dtype=torch.bool)
    for slot in stored.tolist():
        page, off = divmod(slot, page_size)
        at = layout.model1_offsets(page_size, off)
        written[page, at.nope:at.nope + layout.TOKEN_DATA_BYTES] = True
        written[page, at.scales:at.scales + layout.TOKEN_SCALE_BYTES] = True
    assert torch.equal(fused[~written], cache[~written])
    assert (fused[written] == unfused[written]).float().mean() >= 0.99
    got, want = (kv_store.gather_model1(c.cpu(), stored.cpu(), page_size).float() for c in (fused, unfused))
    torch.testing.assert_close(got, want, rtol=2 ** -3, atol=2 ** -6)
    reference = cache.clone()
    kv_store.store_model1(reference, slots, ref.rms_norm_rope(x, w, 1e-6, round_scale, positions, inv_freq),
                          page_size)
    torch.testing.assert_close(got, kv_store.gather_model1(reference.cpu(), stored.cpu(), page_size).float(),
                               rtol=2 ** -3, atol=2 ** -6)


def test_store_variant_no_tokens(device):
    x, _, positions, inv_freq = _inputs(device, (0, 512), None)
    cache = torch.zeros(2, layout.model1_page_bytes(layout.SWA_PAGE_SIZE), dtype=torch.uint8, device=device)
    kernels.launch_rms_norm_rope_store_kv(cache, positions, x, None, 1e-6, True, positions, inv_freq,
                                          layout.SWA_PAGE_SIZE)
    assert not cache.any()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("shape, positions_shape", [((5, 512), (5,)), ((4, 3, 512), (4, 1)), ((3, 2, 192), (3, 1)),
                                                    ((3, 2, 96), (2,)), ((2, 3, 64), (2, 3))])
@pytest.mark.parametrize("inverse", [False, True])
def test_rope_kernel_matches_reference(device, dtype, shape, positions_shape, inverse):
    """``dsv4::rope_tail``'s kernel: RoPE or its inverse on the last 64 dims (all of them for a row
    of 64), token-major positions read in place, positions broadcast otherwise ([2] over a query's
    heads, one per row)."""
    x, _, _, inv_freq = _inputs(device, shape, None)
    x = x.to(dtype)
    positions = torch.randint(0, 1 << 20, positions_shape, generator=torch.Generator(device=device).manual_seed(1),
                              device=device)
    got = kernels.launch_rope_tail(x, positions, inv_freq, inverse)
    want = ref.rope_tail(x, positions, inv_freq, inverse)
    assert got.shape == x.shape and got.dtype == x.dtype
    assert torch.equal(got[..., :-64], x[..., :-64])
    _close(got, want)
    assert not torch.allclose(got[..., -64:].float(), x[..., -64:].float(), atol=0.1)
    if inverse:  # the inverse undoes the rotation
        _close(kernels.launch_rope_tail(got, positions, inv_freq, False), x)


def test_rope_kernel_odd_pairs_int32_positions_and_no_rows(device):
    x, _, positions, _ = _inputs(device, (4, 2, 100), None, seed=2)
    inv_freq = 10000.0 ** (-torch.arange(0, 24, 2, device=device).float() / 24)  # 12 pairs
    at_tokens = positions.unsqueeze(1)
    got = kernels.launch_rope_tail(x, at_tokens, inv_freq, True)
    _close(got, ref.rope_tail(x, at_tokens, inv_freq, True))
    assert torch.equal(kernels.launch_rope_tail(x, at_tokens.int(), inv_freq, True), got)
    assert kernels.launch_rope_tail(x[:0], at_tokens[:0], inv_freq).shape == (0, 2, 100)
