"""Out-of-range indices on CUDA buffers, through ``torch.ops.dsv4`` (the registered CUDA kernels;
docs/semantics.md §6, "Out-of-range indices"): every op given a slice of a larger CUDA buffer
writes nothing and reads nothing outside it — the guard rows before and after stay
byte-identical — and out-of-range indices read as "no entry". The same cases as the CPU and
interpreter tests (``tests/support/bounds.py``), at small shapes; metadata fields equal the
reference's, compressor entries and rings are checked against it.
"""

import pytest
import torch

from dsv4_compile import layout
from dsv4_compile.testing import compress_index
from tests.support import bounds

pytestmark = pytest.mark.gpu

ops = torch.ops.dsv4
CUDA = "cuda"


@pytest.mark.parametrize("page_size", [layout.C128_PAGE_SIZE, layout.C4_PAGE_SIZE, layout.SWA_PAGE_SIZE])
@pytest.mark.parametrize("slot_dtype", [torch.int32, torch.int64])
def test_store_kv_guard_bytes(page_size, slot_dtype):
    bounds.store_kv_case(ops, CUDA, page_size, slot_dtype)


@pytest.mark.parametrize("slot_dtype", [torch.int32, torch.int64])
def test_store_index_k_guard_bytes(slot_dtype):
    bounds.store_index_k_case(ops, CUDA, slot_dtype)


@pytest.mark.parametrize("page_size", [layout.C128_PAGE_SIZE, layout.C4_PAGE_SIZE, layout.SWA_PAGE_SIZE])
def test_dequant_kv_out_of_range_reads_zeros(page_size):
    bounds.dequant_kv_case(ops, CUDA, page_size)


def test_page_table_guard_rows():
    bounds.page_table_case(ops, CUDA)


def test_swa_metadata_guard_rows():
    bounds.swa_metadata_case(ops, CUDA)


def test_compressed_out_slots_of_out_of_range_request_rows():
    got = bounds.compressed_out_loc_case(ops, CUDA)
    want = bounds.compressed_out_loc_case(bounds.references(), CUDA)
    for name, w in want.items():
        assert torch.equal(got[name], w), name


def test_step_metadata_negative_out_slots_and_bad_request_rows():
    got = bounds.step_metadata_case(ops, CUDA)
    want = bounds.step_metadata_case(bounds.references(), CUDA)
    for name, w in want.items():
        assert torch.equal(got[name], w), name


@pytest.mark.parametrize("ratio", [4, 128])
def test_compress_kv_guard_rings(ratio):
    def run(args):  # the CUDA kernel, checked against the reference on a copy of the state
        out = []
        compress_index.check_compress_kv(lambda **kw: out.append(ops.compress_kv(**kw)) or out[0], args)
        return out[0]
    bounds.compress_kv_bad_rows_case(run, CUDA, ratio)


def test_compress_kv_ignores_nan_in_masked_slots():
    bounds.compress_kv_masked_nan_case(ops, CUDA)



def test_compress_kv_ring_beside_skipped_rows():
    bounds.compress_kv_ring_beside_skipped_rows_case(lambda args: ops.compress_kv(**args), CUDA)


@pytest.mark.parametrize("d", [512, 128])
def test_compress_kv_store_guard_pages(d):
    bounds.compress_kv_store_case(ops, CUDA, d)


@pytest.mark.parametrize("narrow", [False, True])
def test_indexer_topk_guard_pages(narrow):
    bounds.indexer_topk_case(ops, CUDA, narrow)


def test_int64_values_past_int32():
    bounds.int64_past_int32_case(ops, CUDA)
