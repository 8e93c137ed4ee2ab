"""The sparse-attention reference's two forms of the same math: keys gathered per row
(``gather_rows`` + ``attend``: every device, and while tracing) and, on the CPU eagerly, set by
set with each distinct cache entry once (``attend_sets``), where a chunk's rows share their
entries (a prefill chunk's overlapping windows) and gathered per row where they do not."""

import pytest
import torch

from dsv4_compile.reference import sparse_attn as ref
from dsv4_compile.testing.attn_inputs import assert_attn_close, golden_sparse_attn, make_attn_inputs

ROWS = 24


def _inputs(extra, shared, seed=0):
    """Random inputs (holes, ragged and empty rows, an all-invalid row, out-of-range sentinels,
    infinite sinks); ``shared``: the SWA lists are one request's overlapping windows (row r reads
    the 128 slots before its own) and the extra lists pick from 40 entries, as a prefill chunk's
    rows do; both span two pages."""
    inp = make_attn_inputs(ROWS, 8, extra=extra, holes=0.1, ragged=True, sentinels=not shared, empty_rows=2,
                           invalid_rows=1, special_sink=True, seed=seed)
    if shared:
        window = torch.arange(128) + torch.arange(ROWS).unsqueeze(1) + 200  # across pages 0 and 1
        inp.swa.indices.copy_(torch.where(inp.swa.indices >= 0, window, -1))
        if extra is not None:
            gen = torch.Generator().manual_seed(seed)
            picks = torch.randint(0, 40, inp.extra.indices.shape, generator=gen) + 100  # across two pages
            inp.extra.indices.copy_(torch.where(inp.extra.indices >= 0, picks, -1))
    return inp


def _shared_sets(inp) -> list[bool]:
    """Which sets ``attend_sets`` takes in the distinct-entry form."""
    forms = []
    for kv in inp.kv_sets():
        entries, where, _ = ref.distinct_entries(kv, 0, ROWS)
        forms.append(entries.shape[0] <= sum(where.shape))
    return forms


@pytest.mark.parametrize("extra", [None, "c4", "c128"])
@pytest.mark.parametrize("shared", [True, False])
def test_set_by_set_equals_the_gathered_keys(extra, shared):
    inp = _inputs(extra, shared)
    assert _shared_sets(inp) == [shared] * len(inp.kv_sets())
    sets, q, sink = inp.kv_sets(), inp.q.float(), inp.attn_sink.float()
    out, lse = ref.attend_sets(q, sets, 0, ROWS, sink, inp.softmax_scale)
    want_out, want_lse = ref.attend(q, *ref.gather_rows(sets, 0, ROWS, torch.float32), sink, inp.softmax_scale)
    torch.testing.assert_close(out, want_out, rtol=1e-4, atol=1e-5 * want_out.abs().max().item())
    assert torch.equal(lse.isinf(), want_lse.isinf()) and torch.equal(lse[lse.isinf()], want_lse[want_lse.isinf()])
    torch.testing.assert_close(lse[lse.isfinite()], want_lse[want_lse.isfinite()], rtol=1e-6, atol=1e-5)


@pytest.mark.parametrize("extra", [None, "c4"])
@pytest.mark.parametrize("shared", [True, False])
def test_reference_against_the_fp64_golden(extra, shared):
    """``sparse_attn`` on the CPU within the fp64 golden's bar of the gathered-keys form."""
    inp = _inputs(extra, shared, seed=1)
    sets = inp.kv_sets()
    out, lse = ref.attend(inp.q.float(), *ref.gather_rows(sets, 0, ROWS, torch.float32), inp.attn_sink.float(),
                          inp.softmax_scale)
    assert_attn_close(ref.sparse_attn(*inp.args()), (out.bfloat16(), lse), golden_sparse_attn(inp), "reference")


def _pages_reversed(kv):
    """The same entries on the cache's pages in reverse order, the lists pointing at them."""
    pages = kv.cache.shape[0]
    page, off = kv.indices.long().div(kv.page_size, rounding_mode="floor"), kv.indices.long() % kv.page_size
    moved = torch.where(kv.indices >= 0, (pages - 1 - page) * kv.page_size + off, kv.indices.long())
    return kv._replace(cache=kv.cache.flip(0), indices=moved.to(kv.indices.dtype))


@pytest.mark.parametrize("extra", [None, "c4"])
def test_set_by_set_does_not_depend_on_the_pages_given(extra):
    """The same rows reading the same entries from other pages (slot order changed): the same
    output to the bit, as the gathered form gives (a request's result must not depend on the
    pages the allocator handed it)."""
    inp = _inputs(extra, shared=True)
    moved = [_pages_reversed(kv) for kv in inp.kv_sets()]
    assert all(torch.equal(ref.gather_rows([a], 0, ROWS, torch.float32)[0], ref.gather_rows([b], 0, ROWS, torch.float32)[0])
               for a, b in zip(inp.kv_sets(), moved))
    args = (inp.q.float(), inp.attn_sink.float(), inp.softmax_scale)
    (out, lse), (moved_out, moved_lse) = (ref.attend_sets(args[0], sets, 0, ROWS, *args[1:])
                                          for sets in (inp.kv_sets(), moved))
    assert torch.equal(out, moved_out) and torch.equal(lse, moved_lse)
