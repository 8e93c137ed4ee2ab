"""Metadata kernels vs the reference (``ops/kernels/metadata.py``): exact int32 equality.

Steps of every mode on a fragmented index map (L_max = 1024: 4 pages, c128 width 64): decode,
uniform and ragged verify, prefill with padding rows, idle with and without rows, lengths on both
sides of 4 / 128 / 256. The five launchers are chained by ``metadata_chain.run_chain`` (as
``build_step_metadata`` chains the ops) and the fused one-launch kernel (``dsv4::step_metadata``)
is compared with the reference of the whole chain; outputs are compared field by field, by name.
"""

import types

import pytest
import torch

from dsv4_compile.metadata_chain import CHAIN_OPS, named, run_chain
from dsv4_compile.ops.kernels import metadata as metadata_kernels
from dsv4_compile.reference import metadata as reference
from dsv4_compile.testing import cache_inputs as inputs

L_MAX = 1024
NUM_REQUESTS = 6
# the launchers under their ops' names, so run_chain can drive them
LAUNCHERS = types.SimpleNamespace(**{op: getattr(metadata_kernels, f"launch_{op}") for op in CHAIN_OPS})

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


def _inputs(device, name):
    gen = torch.Generator(device=device).manual_seed(7)
    req_to_token, full_to_swa = inputs.index_maps(NUM_REQUESTS, L_MAX, gen)
    return req_to_token, full_to_swa, inputs.make_step(req_to_token, *STEPS[name])


def _reference(step_tensors, req_to_token, full_to_swa, topk):
    """Every field of the step from the reference of ``dsv4::step_metadata``, by name."""
    return named(reference.step_metadata(*step_tensors, req_to_token, reference.page_map(req_to_token),
                                         full_to_swa, topk))


def _assert_fields(got, want):
    """Each field of ``got`` (a dict by name) is int32 and equals the field of that name in ``want``."""
    assert got
    for name, g in got.items():
        w = want[name]
        assert g.dtype == torch.int32 and g.shape == w.shape, (name, g.dtype, g.shape, w.shape)
        assert torch.equal(g.cpu(), w.cpu()), (name, g, w)


@pytest.mark.parametrize("name", list(STEPS))
def test_metadata_chain_matches_reference(device, name):
    req_to_token, full_to_swa, step = _inputs(device, name)
    for topk in (2, 512):
        got = run_chain(LAUNCHERS, *step.tensors(), req_to_token, reference.page_map(req_to_token), full_to_swa, topk)
        _assert_fields(got, _reference(step.tensors(), req_to_token, full_to_swa, topk))


@pytest.mark.parametrize("name", list(STEPS))
def test_fused_step_metadata_matches_reference(device, name):
    req_to_token, full_to_swa, step = _inputs(device, name)
    got = metadata_kernels.launch_step_metadata(*step.tensors(), req_to_token, reference.page_map(req_to_token),
                                                full_to_swa, 3)
    _assert_fields(named(got), _reference(step.tensors(), req_to_token, full_to_swa, 3))


def test_int64_inputs_and_negative_full_slots(device):
    """int64 step tensors and upstream fields; ``full_to_swa`` int64 ending in -1, and stale -1 full
    slots in ``req_to_token``: a negative full slot reads as "no entry" (-1), never ``t[-1]``."""
    req_to_token, full_to_swa, step = _inputs(device, "verify_ragged")
    full_to_swa = torch.cat([full_to_swa.long(), full_to_swa.new_full((1,), -1, dtype=torch.int64)])
    req_to_token = req_to_token.long()
    req_to_token[step.req_rows[0], [128, 256]] = -1  # stale -1 slots: in a window, at a page start
    step_tensors = tuple(t.long() for t in step.tensors())
    loc, req_to_page = step.out_cache_loc, reference.page_map(req_to_token)
    want = _reference(step_tensors, req_to_token, full_to_swa, 512)
    req_of_row, seq_causal, page_table = (want[k].long() for k in ("req_of_row", "seq_lens_causal", "page_table"))
    launched = {
        "expand_queries": metadata_kernels.launch_expand_queries(*step_tensors),
        "build_page_table": metadata_kernels.launch_build_page_table(req_to_page, req_of_row, seq_causal),
        "build_swa_metadata": metadata_kernels.launch_build_swa_metadata(req_to_token, full_to_swa, req_of_row,
                                                                         seq_causal, loc),
        "build_c128_metadata": metadata_kernels.launch_build_c128_metadata(page_table, req_of_row, seq_causal, loc,
                                                                           req_to_token.shape[0]),
    }
    for op, outputs in launched.items():
        _assert_fields(named(outputs, op), want)
    _assert_fields(named(metadata_kernels.launch_step_metadata(*step_tensors, req_to_token, req_to_page,
                                                               full_to_swa, 512)), want)


def test_wide_rows_span_column_blocks(device):
    """L_max = 512k: page table (2048 wide) and c128 indices (4096) span several programs per row."""
    gen = torch.Generator(device=device).manual_seed(8)
    req_to_token, full_to_swa = inputs.index_maps(3, 1 << 19, gen)
    step = inputs.make_step(req_to_token, [3, 1, 2], [1 << 19, 300000, 129], [1, 2, 1])
    req_to_page = reference.page_map(req_to_token)
    want = _reference(step.tensors(), req_to_token, full_to_swa, 512)
    _assert_fields(named(metadata_kernels.launch_step_metadata(*step.tensors(), req_to_token, req_to_page,
                                                               full_to_swa, 512)), want)
    req_of_row, seq_causal = want["req_of_row"], want["seq_lens_causal"]
    _assert_fields(named(metadata_kernels.launch_build_page_table(req_to_page, req_of_row, seq_causal),
                         "build_page_table"), want)
    _assert_fields(named(metadata_kernels.launch_build_c128_metadata(want["page_table"], req_of_row, seq_causal,
                                                                     step.out_cache_loc, req_to_token.shape[0]),
                         "build_c128_metadata"), want)


def test_expand_many_requests_crosses_chunks(device):
    """More requests than one chunk of the in-kernel prefix sum (1024), with empty requests."""
    b = 1100
    extend = torch.zeros(b, dtype=torch.int32)
    extend[[0, 3, 1023, 1024, 1099]] = torch.tensor([2, 1, 3, 1, 2], dtype=torch.int32)
    seq = extend + torch.arange(b, dtype=torch.int32)
    req_rows = torch.arange(b, dtype=torch.int32).flip(0)
    args = [x.to(device) for x in (req_rows, seq, extend, torch.zeros(11, dtype=torch.int64))]
    _assert_fields(named(metadata_kernels.launch_expand_queries(*args), "expand_queries"),
                   named(reference.expand_queries(*args), "expand_queries"))


def test_strided_page_table_input(device):
    req_to_token, full_to_swa, step = _inputs(device, "decode")
    want = _reference(step.tensors(), req_to_token, full_to_swa, 512)
    page_table = want["page_table"]
    strided = torch.zeros(page_table.shape[1], page_table.shape[0], dtype=torch.int32, device=device).t()
    strided.copy_(page_table)
    got = metadata_kernels.launch_build_c128_metadata(strided, want["req_of_row"], want["seq_lens_causal"],
                                                      step.out_cache_loc, req_to_token.shape[0])
    _assert_fields(named(got, "build_c128_metadata"), want)
