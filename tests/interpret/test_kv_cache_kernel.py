"""Cache-write / read kernels vs the reference (``ops/kernels/kv_cache.py``), small shapes.

Caches start as random canary bytes; the kernel and the reference write into two copies. Checks:
the whole cache equals the reference's byte for byte (fp8 codes, ue8m0 scales, the zero pad byte,
bf16 rope), bytes of pages, tokens and page padding that no valid row addresses keep their
canaries, negative slots write nothing, and the reads equal the reference's.

Byte equality holds under the interpreter too: there the kernels cast to fp8 in integer
arithmetic (the interpreter's own cast mis-rounds), on the GPU with the hardware cast; both are
checked against every finite bf16 input in [-448, 448].
"""

import pytest
import torch

from dsv4_compile import layout
from dsv4_compile.config import INDEX_HEAD_DIM
from dsv4_compile.ops.kernels import kv_cache as kv_cache_kernels
from dsv4_compile.reference import kv_store as ref
from dsv4_compile.testing import cache_inputs as inputs


def _gen(device, seed=0):
    return torch.Generator(device=device).manual_seed(seed)


def _canary_cache(num_pages, page_bytes, gen, *, pad_pages=False):
    """Random bytes; with ``pad_pages`` a strided view (pages in a wider buffer)."""
    width = page_bytes + (128 if pad_pages else 0)
    buf = torch.randint(0, 256, (num_pages, width), generator=gen, device=gen.device, dtype=torch.uint8)
    return buf[:, :page_bytes]


def _written_mask(cache, slots, spans):
    """Bool mask of the cache bytes that valid ``slots`` address: ``spans(off) -> [(start, len)]``."""
    mask = torch.zeros(cache.shape, dtype=torch.bool)
    for s in slots.tolist():
        if s >= 0:
            for start, n in spans(s):
                mask[start[0], start[1]:start[1] + n] = True
    return mask


def _model1_spans(page_size):
    def spans(slot):
        page, off = divmod(slot, page_size)
        o = layout.model1_offsets(page_size, off)
        return [((page, o.nope), layout.TOKEN_DATA_BYTES), ((page, o.scales), layout.TOKEN_SCALE_BYTES)]
    return spans


def _index_spans(page_size):
    def spans(slot):
        page, off = divmod(slot, page_size)
        return [((page, off * INDEX_HEAD_DIM), INDEX_HEAD_DIM), ((page, page_size * INDEX_HEAD_DIM + 4 * off), 4)]
    return spans


def _assert_write(got, want, before, slots, spans):
    """Untouched bytes keep their canaries; written bytes equal the reference's."""
    torch.testing.assert_close(got.cpu(), want.cpu(), rtol=0, atol=0)
    mask = _written_mask(got.cpu(), slots.cpu(), spans)
    assert torch.equal(got.cpu()[~mask], before.cpu()[~mask])


@pytest.mark.parametrize("page_size", [layout.C128_PAGE_SIZE, layout.C4_PAGE_SIZE, layout.SWA_PAGE_SIZE])
@pytest.mark.parametrize("slot_dtype", [torch.int32, torch.int64])
def test_store_kv_matches_reference(device, page_size, slot_dtype):
    gen = _gen(device)
    num_pages = 4 if page_size > 2 else 12
    cache = _canary_cache(num_pages, layout.model1_page_bytes(page_size), gen, pad_pages=page_size == 64)
    slots = inputs.distinct_slots(9, num_pages, page_size, gen, dtype=slot_dtype, num_negative=2)
    k = inputs.model1_keys(9, gen)
    before = cache.clone()
    got = cache.clone()
    kv_cache_kernels.launch_store_kv(got, slots, k, page_size)
    want = cache.clone()
    ref.store_model1(want, slots, k, page_size)
    _assert_write(got, want, before, slots, _model1_spans(page_size))


def test_store_kv_every_bf16_value(device):
    """Every finite bf16 in [-448, 448] at scale 1: the fp8 cast is round-to-nearest-even."""
    k = inputs.all_bf16_tiles().to(device)
    page_size = layout.C4_PAGE_SIZE
    slots = torch.arange(k.shape[0], device=device) + page_size
    cache = torch.zeros(2 + k.shape[0] // page_size, layout.model1_page_bytes(page_size), dtype=torch.uint8,
                        device=device)
    got, want = cache.clone(), cache.clone()
    kv_cache_kernels.launch_store_kv(got, slots, k, page_size)
    ref.store_model1(want, slots, k, page_size)
    assert torch.equal(got.cpu(), want.cpu())


def test_store_kv_all_negative_and_empty(device):
    gen = _gen(device, 1)
    cache = _canary_cache(3, layout.model1_page_bytes(2), gen)
    before = cache.clone()
    kv_cache_kernels.launch_store_kv(cache, torch.full((4,), -1, device=device), inputs.model1_keys(4, gen), 2)
    kv_cache_kernels.launch_store_kv(cache, torch.zeros(0, dtype=torch.int64, device=device),
                      torch.zeros(0, 512, dtype=torch.bfloat16, device=device), 2)
    assert torch.equal(cache.cpu(), before.cpu())


@pytest.mark.parametrize("page_size", [layout.C128_PAGE_SIZE, layout.SWA_PAGE_SIZE])
def test_dequant_kv_matches_reference(device, page_size):
    gen = _gen(device, 2)
    cache = torch.zeros(5, layout.model1_page_bytes(page_size), dtype=torch.uint8, device=device)
    slots = torch.cat([inputs.distinct_slots(5, 5, page_size, gen), torch.zeros(1, dtype=torch.int64,
                                                                                device=device)])
    ref.store_model1(cache, slots, inputs.model1_keys(6, gen), page_size)  # slot 0 holds a key too
    read = torch.cat([slots[:4], torch.tensor([-1, 0], device=device)])  # -1 reads zeros
    got = kv_cache_kernels.launch_dequant_kv(cache, read, page_size)
    want = ref.gather_model1(cache, read, page_size).to(torch.bfloat16)
    assert got.dtype == torch.bfloat16 and got.shape == (6, 512)
    assert torch.equal(got.cpu(), want.cpu())


@pytest.mark.parametrize("k_dtype", [torch.bfloat16, torch.float32])
def test_store_index_k_matches_reference(device, k_dtype):
    gen = _gen(device, 3)
    page_size = layout.INDEX_PAGE_SIZE
    cache = _canary_cache(3, layout.index_page_bytes(page_size), gen)
    slots = inputs.distinct_slots(10, 3, page_size, gen, num_negative=3)
    k = inputs.index_keys(10, k_dtype, gen)
    before = cache.clone()
    got = cache.clone()
    kv_cache_kernels.launch_store_index_k(got, slots, k, page_size)
    # the reference on the CPU: on CUDA, torch turns its ``amax / 448`` into ``amax * (1 / 448)``
    want = cache.to("cpu", copy=True)
    ref.store_index_k(want, slots.cpu(), k.cpu(), page_size)
    _assert_write(got, want, before, slots, _index_spans(page_size))


def test_store_kv_non_contiguous_keys(device):
    gen = _gen(device, 4)
    wide = inputs.model1_keys(5, gen).repeat(1, 2)  # [5, 1024]: rows of stride 1024
    k = wide[:, :512]
    cache = torch.zeros(4, layout.model1_page_bytes(2), dtype=torch.uint8, device=device)
    slots = inputs.distinct_slots(5, 4, 2, gen)
    got, want = cache.clone(), cache.clone()
    kv_cache_kernels.launch_store_kv(got, slots, k, 2)
    ref.store_model1(want, slots, k.contiguous(), 2)
    assert torch.equal(got.cpu(), want.cpu())
