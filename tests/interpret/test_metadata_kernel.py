"""Metadata kernels vs the reference (``ops/kernels/metadata.py``): exact int32 equality.

Steps of every mode on a fragmented index map (L_max = 1024: 4 pages, c128 width 64): decode,
uniform and ragged verify, prefill with padding rows, idle with and without rows, lengths on both
sides of 4 / 128 / 256. The chain is run the way ``build_step_metadata`` runs it, each kernel fed
the reference's upstream outputs; the fused one-launch kernel (``dsv4::step_metadata``) is
compared with the whole reference chain.
"""

import pytest
import torch

from dsv4_compile.ops.kernels import metadata as K
from dsv4_compile.reference import metadata as ref
from dsv4_compile.testing import cache_inputs as inputs

L_MAX = 1024
NUM_REQUESTS = 6

# name -> (req_rows, seq_lens (post-step), extend_lens, num_tokens or None = sum(extend_lens))
STEPS = {
    "decode": ([1, 2, 3, 4, 5, 6], [1, 4, 128, 129, 256, 1000], [1] * 6, None),
    "decode_bucket_pad": ([1, 2, 0], [257, 5, 0], [1, 1, 0], 3),
    "verify_uniform": ([3, 1], [130, 259], [3, 3], None),
    "verify_ragged": ([2, 4, 5], [131, 8, 512], [2, 0, 4], 8),
    "prefill_padded": ([6, 1, 2], [140, 3, 1024], [12, 3, 7], 26),
    "idle_rows": ([], [], [], 4),
    "idle_empty": ([], [], [], 0),
}


def _inputs(device, name, full_to_swa_dtype=torch.int32):
    gen = torch.Generator(device=device).manual_seed(7)
    req_to_token, full_to_swa = inputs.index_maps(NUM_REQUESTS, L_MAX, gen)
    step = inputs.make_step(req_to_token, *STEPS[name])
    return req_to_token, full_to_swa.to(full_to_swa_dtype), step


def _assert_same(got, want):
    for g, w in zip(got, want, strict=True):
        assert g.dtype == torch.int32 and g.shape == w.shape, (g.dtype, g.shape, w.shape)
        assert torch.equal(g.cpu(), w.cpu()), (g, w)


@pytest.mark.parametrize("name", list(STEPS))
def test_metadata_chain_matches_reference(device, name):
    req_to_token, full_to_swa, (req_rows, seq_lens, extend_lens, out_cache_loc) = _inputs(device, name)
    t = out_cache_loc.shape[0]
    expanded = ref.expand_queries(req_rows, seq_lens, extend_lens, t)
    _assert_same(K.launch_expand_queries(req_rows, seq_lens, extend_lens, t), expanded)
    req_of_row, seq_causal = expanded[:2]

    page_table = ref.build_page_table(ref.page_map(req_to_token), req_of_row, seq_causal)
    _assert_same([K.launch_build_page_table(ref.page_map(req_to_token), req_of_row, seq_causal)], [page_table])
    _assert_same(K.launch_build_swa_metadata(req_to_token, full_to_swa, req_of_row, seq_causal, out_cache_loc),
                 ref.build_swa_metadata(req_to_token, full_to_swa, req_of_row, seq_causal, out_cache_loc))
    for topk in (2, 512):
        _assert_same(K.launch_build_c4_metadata(seq_causal, out_cache_loc, topk),
                     ref.build_c4_metadata(seq_causal, out_cache_loc, topk))
    _assert_same(K.launch_build_c128_metadata(page_table, seq_causal, out_cache_loc),
                 ref.build_c128_metadata(page_table, seq_causal, out_cache_loc))


def _reference_chain(step, req_to_token, full_to_swa, topk):
    """Outputs of the five reference builders of a step, in ``dsv4::step_metadata`` order."""
    return ref.step_metadata(*step, req_to_token, ref.page_map(req_to_token), full_to_swa, topk)


@pytest.mark.parametrize("name", list(STEPS))
def test_fused_step_metadata_matches_reference(device, name):
    req_to_token, full_to_swa, step = _inputs(device, name)
    _assert_same(K.launch_step_metadata(*step, req_to_token, ref.page_map(req_to_token), full_to_swa, 3),
                 _reference_chain(step, req_to_token, full_to_swa, 3))


def test_int64_inputs_and_torch_negative_indexing(device):
    """int64 step tensors; ``full_to_swa`` int64 ending in -1, read through a -1 slot (``t[-1]``)."""
    req_to_token, full_to_swa, (req_rows, seq_lens, extend_lens, out_cache_loc) = _inputs(device, "verify_ragged")
    full_to_swa = torch.cat([full_to_swa.long(), full_to_swa.new_full((1,), -1, dtype=torch.int64)])
    req_to_token = req_to_token.long()
    req_to_token[req_rows[0], [128, 256]] = -1  # stale -1 slots: in a window, at a page start
    req_rows, seq_lens, extend_lens = req_rows.long(), seq_lens.long(), extend_lens.long()
    t = out_cache_loc.shape[0]
    expanded = ref.expand_queries(req_rows, seq_lens, extend_lens, t)
    _assert_same(K.launch_expand_queries(req_rows, seq_lens, extend_lens, t), expanded)
    req_of_row, seq_causal = (x.long() for x in expanded[:2])
    page_table = ref.build_page_table(ref.page_map(req_to_token), req_of_row, seq_causal).long()
    _assert_same([K.launch_build_page_table(ref.page_map(req_to_token), req_of_row, seq_causal)], [page_table.int()])
    _assert_same(K.launch_build_swa_metadata(req_to_token, full_to_swa, req_of_row, seq_causal, out_cache_loc),
                 ref.build_swa_metadata(req_to_token, full_to_swa, req_of_row, seq_causal, out_cache_loc))
    _assert_same(K.launch_build_c128_metadata(page_table, seq_causal, out_cache_loc),
                 ref.build_c128_metadata(page_table, seq_causal, out_cache_loc))
    step = (req_rows, seq_lens, extend_lens, out_cache_loc)
    _assert_same(K.launch_step_metadata(*step, req_to_token, ref.page_map(req_to_token), full_to_swa, 512),
                 _reference_chain(step, req_to_token, full_to_swa, 512))


def test_wide_rows_span_column_blocks(device):
    """L_max = 512k: page table (2048 wide) and c128 indices (4096) span several programs per row."""
    gen = torch.Generator(device=device).manual_seed(8)
    req_to_token, full_to_swa = inputs.index_maps(3, 1 << 19, gen)
    step = inputs.make_step(req_to_token, [3, 1, 2], [1 << 19, 300000, 129], [1, 2, 1])
    want = _reference_chain(step, req_to_token, full_to_swa, 512)
    _assert_same(K.launch_step_metadata(*step, req_to_token, ref.page_map(req_to_token), full_to_swa, 512), want)
    _assert_same([K.launch_build_page_table(ref.page_map(req_to_token), want[0], want[1])], [want[4]])
    _assert_same(K.launch_build_c128_metadata(want[4], want[1], step[3]), want[11:])


def test_expand_many_requests_crosses_chunks(device):
    """More requests than one chunk of the in-kernel prefix sum (1024), with empty requests."""
    b = 1100
    extend = torch.zeros(b, dtype=torch.int32)
    extend[[0, 3, 1023, 1024, 1099]] = torch.tensor([2, 1, 3, 1, 2], dtype=torch.int32)
    seq = extend + torch.arange(b, dtype=torch.int32)
    req_rows = torch.arange(b, dtype=torch.int32).flip(0)
    args = [x.to(device) for x in (req_rows, seq, extend)]
    _assert_same(K.launch_expand_queries(*args, 11), ref.expand_queries(*args, 11))


def test_strided_page_table_input(device):
    req_to_token, _, (req_rows, seq_lens, extend_lens, out_cache_loc) = _inputs(device, "decode")
    req_of_row, seq_causal, _, _ = ref.expand_queries(req_rows, seq_lens, extend_lens, out_cache_loc.shape[0])
    page_table = ref.build_page_table(ref.page_map(req_to_token), req_of_row, seq_causal)
    strided = torch.zeros(page_table.shape[1], page_table.shape[0], dtype=torch.int32, device=device).t()
    strided.copy_(page_table)
    _assert_same(K.launch_build_c128_metadata(strided, seq_causal, out_cache_loc),
                 ref.build_c128_metadata(page_table, seq_causal, out_cache_loc))
