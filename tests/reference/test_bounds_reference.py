"""Out-of-range indices on the CPU, where ``torch.ops.dsv4`` runs the references
(docs/semantics.md §6, "Out-of-range indices"): slots, request rows, positions, full slots and
pages outside the buffers given are skipped on writes and read as "no entry", with no
``IndexError`` and no wrap-around of negative values; every buffer is a slice between guard rows
that must stay byte-identical. The cases live in ``tests/support/bounds.py``.
"""

import pytest
import torch

from dsv4_compile import layout
from tests.support import bounds

ops = torch.ops.dsv4


@pytest.mark.parametrize("page_size", [layout.C128_PAGE_SIZE, layout.C4_PAGE_SIZE, layout.SWA_PAGE_SIZE])
@pytest.mark.parametrize("slot_dtype", [torch.int32, torch.int64])
def test_store_kv_skips_out_of_range_slots(page_size, slot_dtype):
    bounds.store_kv_case(ops, "cpu", page_size, slot_dtype)


@pytest.mark.parametrize("slot_dtype", [torch.int32, torch.int64])
def test_store_index_k_skips_out_of_range_slots(slot_dtype):
    bounds.store_index_k_case(ops, "cpu", slot_dtype)


@pytest.mark.parametrize("page_size", [layout.C128_PAGE_SIZE, layout.C4_PAGE_SIZE])
def test_dequant_kv_reads_zeros_out_of_range(page_size):
    bounds.dequant_kv_case(ops, "cpu", page_size)


def test_page_table_of_out_of_range_request_rows():
    bounds.page_table_case(ops, "cpu")


def test_swa_metadata_out_of_range_rows_positions_and_slots():
    bounds.swa_metadata_case(ops, "cpu")


def test_compressed_out_slots_of_out_of_range_request_rows():
    bounds.compressed_out_loc_case(ops, "cpu")


def test_step_metadata_negative_out_slots_and_bad_request_rows():
    bounds.step_metadata_case(ops, "cpu")


@pytest.mark.parametrize("ratio", [4, 128])
def test_compress_kv_out_of_range_request_rows(ratio):
    bounds.compress_kv_bad_rows_case(lambda args: ops.compress_kv(**args), "cpu", ratio)


def test_compress_kv_ring_beside_skipped_rows():
    bounds.compress_kv_ring_beside_skipped_rows_case(lambda args: ops.compress_kv(**args), "cpu")


@pytest.mark.parametrize("d", [512, 128])
def test_compress_kv_store_skips_out_of_range_slots(d):
    bounds.compress_kv_store_case(ops, "cpu", d)


def test_compress_kv_ignores_nan_in_masked_slots():
    bounds.compress_kv_masked_nan_case(ops, "cpu")


@pytest.mark.parametrize("narrow", [False, True])
def test_indexer_topk_pages_outside_the_cache(narrow):
    bounds.indexer_topk_case(ops, "cpu", narrow)


def test_int64_values_past_int32():
    bounds.int64_past_int32_case(ops, "cpu")
