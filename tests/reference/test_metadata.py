"""Metadata references (docs/semantics.md §3), including the worked decode example of
docs/semantics.md §4.8, and the fused reference against the field table."""

import torch

from dsv4_compile import layout
from dsv4_compile.metadata_chain import FIELDS, named
from dsv4_compile.reference import indexer, metadata
from dsv4_compile.testing import cache_inputs as inputs

I32 = torch.int32


def _rows(t):
    """An ``out_cache_loc`` of ``t`` rows: ``expand_queries`` reads only its length."""
    return torch.zeros(t, dtype=torch.int64)


def _fields(op, *args):
    """The outputs of reference function ``op`` by field name."""
    return named(getattr(metadata, op)(*args), op)


def _expand(*args):
    m = _fields("expand_queries", *args)
    return m["req_of_row"], m["seq_lens_causal"], m["extend_start"], m["extend_end"]


def _worked_example():
    """Request row 5, pages 17 (positions 0-255) and 42 (256-511), seq_len 300 after this step;
    SWA pages 3 and 7 back full pages 17 and 42."""
    L_max = 1024
    req_to_token = torch.zeros(8, L_max, dtype=I32)
    pos = torch.arange(300)
    req_to_token[5, :300] = torch.where(pos < 256, 17, 42) * 256 + pos % 256
    full_to_swa = torch.zeros(64 * 256, dtype=I32)
    full_to_swa[17 * 256:18 * 256] = 3 * 256 + torch.arange(256)
    full_to_swa[42 * 256:43 * 256] = 7 * 256 + torch.arange(256)
    return req_to_token, full_to_swa


def test_worked_decode_example():
    req_to_token, full_to_swa = _worked_example()
    out_cache_loc = torch.tensor([42 * 256 + 43])
    assert out_cache_loc.item() == 10795
    req, seq, start, end = _expand(torch.tensor([5], dtype=I32), torch.tensor([300], dtype=I32),
                                   torch.tensor([1], dtype=I32), out_cache_loc)
    assert (req.item(), seq.item(), start.item(), end.item()) == (5, 300, 299, 300)
    req_to_page = metadata.page_map(req_to_token)
    page_table = metadata.build_page_table(req_to_page, req, seq)
    assert page_table.shape == (1, 4) and page_table[0].tolist() == [17, 42, 0, 0]
    req_to_page[5, 2] = 99  # stale entries past the row's length are never read
    assert torch.equal(metadata.build_page_table(req_to_page, req, seq), page_table)
    swa = _fields("build_swa_metadata", req_to_token, full_to_swa, req, seq, out_cache_loc)
    k = torch.arange(128)
    p = 299 - k
    want = torch.where(p >= 256, 7 * 256 + (p - 256), 3 * 256 + p)  # positions 299 ... 172
    assert torch.equal(swa["swa_indices"][0], want.to(I32)) and swa["swa_lengths"].item() == 128
    assert swa["swa_out_loc"].item() == 7 * 256 + 43
    rows = req_to_token.shape[0]
    c4 = _fields("build_c4_metadata", req, seq, out_cache_loc, 512, rows)
    assert c4["c4_out_loc"].item() == 2698 == 42 * 64 + 10  # entry 74 (positions 296-299) at c4 page 42 offset 10
    c4_visible = c4["c4_visible"]
    assert c4_visible.item() == 75 and c4["c4_topk_lengths"].item() == 75
    c128 = _fields("build_c128_metadata", page_table, req, seq, out_cache_loc, rows)
    c128_idx = c128["c128_indices"]
    assert c128["c128_out_loc"].item() == -1  # 300 % 128 != 0: nothing to store
    assert c128["c128_lengths"].item() == 2
    assert c128_idx.shape == (1, 64) and c128_idx[0, :3].tolist() == [34, 35, -1]
    assert torch.all(c128_idx[0, 2:] == -1)
    # 75 visible entries <= top-k 512: the indexer selects all of them, unscored, in order
    index_cache = torch.randint(0, 120, (64, layout.index_page_bytes()), dtype=torch.uint8)
    q_fp8 = torch.randn(1, 4, 128).to(torch.float8_e4m3fn)
    sel = indexer.indexer_topk(q_fp8, torch.rand(1, 4), index_cache, page_table, c4_visible, 512)
    j = torch.arange(75)
    assert torch.equal(sel[0, :75], torch.where(j < 64, 17 * 64 + j, 42 * 64 + j - 64).to(I32))
    assert torch.all(sel[0, 75:] == -1)


def test_expand_uniform_verify():
    rows = torch.tensor([3, 1], dtype=I32)
    seq = torch.tensor([10, 5], dtype=I32)  # post-step: committed 7 and 2, plus D = 3
    req, seq_c, start, end = _expand(rows, seq, torch.tensor([3, 3], dtype=I32), _rows(6))
    assert req.tolist() == [3, 3, 3, 1, 1, 1]
    assert seq_c.tolist() == [8, 9, 10, 3, 4, 5]
    assert start.tolist() == [7, 7, 7, 2, 2, 2] and end.tolist() == [10, 10, 10, 5, 5, 5]


def test_expand_ragged_with_padding_rows_and_empty_requests():
    rows = torch.tensor([2, 0, 4], dtype=I32)  # the middle request is bucket padding
    seq = torch.tensor([6, 0, 300], dtype=I32)
    ext = torch.tensor([2, 0, 3], dtype=I32)
    req, seq_c, start, end = _expand(rows, seq, ext, _rows(8))
    assert req.tolist() == [2, 2, 4, 4, 4, 0, 0, 0]
    assert seq_c.tolist() == [5, 6, 298, 299, 300, 1, 1, 1]
    assert start.tolist() == [4, 4, 297, 297, 297, 0, 0, 0]
    assert end.tolist() == [6, 6, 300, 300, 300, 1, 1, 1]


def test_expand_idle():
    empty = torch.zeros(0, dtype=I32)
    req, seq_c, start, end = _expand(empty, empty, empty, _rows(3))
    assert req.tolist() == [0, 0, 0] and seq_c.tolist() == [1, 1, 1]
    assert all(t.shape == (0,) for t in metadata.expand_queries(empty, empty, empty, _rows(0)))


def test_short_sequences():
    """seq < 4: no c4 entry (length clamps to 1, nothing visible); seq < 128: prefix SWA."""
    req_to_token = torch.zeros(2, 256, dtype=I32)
    req_to_token[1] = 5 * 256 + torch.arange(256)
    full_to_swa = torch.zeros(8 * 256, dtype=I32)
    full_to_swa[5 * 256:6 * 256] = 2 * 256 + torch.arange(256)
    seq = torch.tensor([1, 3, 4, 128], dtype=I32)
    req = torch.ones(4, dtype=I32)
    loc = req_to_token[1, seq.long() - 1].long()
    swa = _fields("build_swa_metadata", req_to_token, full_to_swa, req, seq, loc)
    idx = swa["swa_indices"]
    assert swa["swa_lengths"].tolist() == [1, 3, 4, 128]
    assert idx[1, :4].tolist() == [514, 513, 512, -1]
    assert torch.all(idx[3] >= 512)
    c4 = _fields("build_c4_metadata", req, seq, loc, 512, 2)
    assert c4["c4_visible"].tolist() == [0, 0, 1, 32] and c4["c4_topk_lengths"].tolist() == [1, 1, 1, 32]
    assert c4["c4_out_loc"].tolist() == [-1, -1, (5 * 256 + 3) // 4, (5 * 256 + 127) // 4]
    page_table = metadata.build_page_table(metadata.page_map(req_to_token), req, seq)
    c128 = _fields("build_c128_metadata", page_table, req, seq, loc, 2)
    c128_idx = c128["c128_indices"]
    assert c128["c128_lengths"].tolist() == [1, 1, 1, 1]
    assert torch.all(c128_idx[:3] == -1) and c128_idx[3, 0].item() == 10 and c128_idx[3, 1].item() == -1
    assert c128["c128_out_loc"].tolist() == [-1, -1, -1, (5 * 256 + 127) // 128]


def test_page_table_ends_at_the_last_live_page():
    """Page i is live while 256 i < seq_lens_causal: a row of exactly 256 positions sees page 0 alone,
    its 257th position brings page 1; later entries are 0."""
    req_to_page = torch.tensor([[0, 0, 0, 0], [17, 42, 9, 5]], dtype=I32)
    seq = torch.tensor([1, 255, 256, 257, 512, 513], dtype=I32)
    got = metadata.build_page_table(req_to_page, torch.ones(6, dtype=I32), seq)
    assert got.tolist() == [[17, 0, 0, 0]] * 3 + [[17, 42, 0, 0]] * 2 + [[17, 42, 9, 0]]


def test_fused_reference_follows_the_field_table():
    """``step_metadata`` returns every declared field, in table order, with its declared dtype and
    shape (T = 5 rows, NP = 4 pages: c128 width 64)."""
    gen = torch.Generator().manual_seed(3)
    req_to_token, full_to_swa = inputs.index_maps(3, 1024, gen)
    step = inputs.make_step(req_to_token, [3, 1], [300, 129], [2, 1], 5)
    fused = metadata.step_metadata(*step.tensors(), req_to_token, metadata.page_map(req_to_token), full_to_swa, 64)
    assert len(fused) == len(FIELDS)
    for f, t in zip(FIELDS, fused):
        assert t.dtype == f.dtype and t.shape == f.shape(5, 4), (f.name, t.dtype, t.shape)
    assert named(fused)["c128_indices"].shape == (5, 64)
