"""Out-of-range indices through the Triton kernels (docs/semantics.md §6, "Out-of-range
indices"): every kernel that writes or gathers by an index skips indices outside the buffer it is
given — slots past a cache slice, request rows outside the index maps or the compressor state,
positions past ``L_max``, full slots outside ``full_to_swa``, pages outside the indexer cache —
and the guard rows around each slice stay byte-identical. Results equal the reference's: cache
bytes, metadata fields and rings exactly, compressor entries within the kernel tests' bound. The
cases live in ``tests/support/bounds.py``.
"""

import pytest
import torch

from dsv4_compile import layout
from dsv4_compile.ops.kernels import indexer as indexer_kernels
from dsv4_compile.ops.kernels import topk_select
from dsv4_compile.testing import compress_index
from tests.support import bounds

KERNELS = bounds.launchers()


@pytest.mark.parametrize("page_size", [layout.C128_PAGE_SIZE, layout.C4_PAGE_SIZE, layout.SWA_PAGE_SIZE])
@pytest.mark.parametrize("slot_dtype", [torch.int32, torch.int64])
def test_store_kv_skips_out_of_range_slots(device, page_size, slot_dtype):
    bounds.store_kv_case(KERNELS, device, page_size, slot_dtype)


@pytest.mark.parametrize("slot_dtype", [torch.int32, torch.int64])
def test_store_index_k_skips_out_of_range_slots(device, slot_dtype):
    bounds.store_index_k_case(KERNELS, device, slot_dtype)


@pytest.mark.parametrize("page_size", [layout.C128_PAGE_SIZE, layout.C4_PAGE_SIZE])
def test_dequant_kv_reads_zeros_out_of_range(device, page_size):
    bounds.dequant_kv_case(KERNELS, device, page_size)


def test_page_table_of_out_of_range_request_rows(device):
    bounds.page_table_case(KERNELS, device)


def test_swa_metadata_out_of_range_rows_positions_and_slots(device):
    bounds.swa_metadata_case(KERNELS, device)


def test_compressed_out_slots_of_out_of_range_request_rows(device):
    got = bounds.compressed_out_loc_case(KERNELS, device)
    want = bounds.compressed_out_loc_case(bounds.references(), device)
    for name, w in want.items():
        assert torch.equal(got[name], w), name


def test_step_metadata_negative_out_slots_and_bad_request_rows(device):
    got = bounds.step_metadata_case(KERNELS, device)
    want = bounds.step_metadata_case(bounds.references(), device)
    for name, w in want.items():
        assert torch.equal(got[name], w), name


@pytest.mark.parametrize("ratio", [4, 128])
def test_compress_kv_out_of_range_request_rows(device, ratio):
    def run(args):  # the kernel, checked against the reference on a copy of the state
        out = []
        compress_index.check_compress_kv(lambda **kw: out.append(KERNELS.compress_kv(**kw)) or out[0], args)
        return out[0]
    bounds.compress_kv_bad_rows_case(run, device, ratio)



def test_compress_kv_ring_beside_skipped_rows(device):
    bounds.compress_kv_ring_beside_skipped_rows_case(lambda args: KERNELS.compress_kv(**args), device)


@pytest.mark.parametrize("d", [512, 128])
def test_compress_kv_store_skips_out_of_range_slots(device, d):
    bounds.compress_kv_store_case(KERNELS, device, d)


def test_compress_kv_ignores_nan_in_masked_slots(device):
    bounds.compress_kv_masked_nan_case(KERNELS, device)


@pytest.mark.usefixtures("select_path")
@pytest.mark.parametrize("narrow", [False, True])
def test_indexer_topk_pages_outside_the_cache(device, monkeypatch, narrow):
    monkeypatch.setattr(indexer_kernels, "_SCAN_PROGRAMS", 16)  # several scan and select splits per row
    monkeypatch.setattr(topk_select, "_SELECT_PROGRAMS", 16)
    monkeypatch.setattr(topk_select, "_BLOCK", 128)
    bounds.indexer_topk_case(KERNELS, device, narrow)


def test_int64_values_past_int32(device):
    bounds.int64_past_int32_case(KERNELS, device)
