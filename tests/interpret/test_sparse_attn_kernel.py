"""Sparse-attention kernels (``ops/kernels/sparse_attn_*.py``) vs the reference, tiny shapes.

Inputs (``testing/attn_inputs.py``): one SWA page of slots plus a c4 / c128 extra cache or none,
index lists of 64 / 128 scattered over the pools with -1 holes, sentinel indices (INT32_MIN,
capacity, INT32_MAX) inside the lengths, ragged and over-long lengths, an empty row (length 0), a
row whose indices are all -1, sinks of +inf (head 0) and -inf (head 1). Checks, for the
single-program path (32-key blocks), the split + combine path (64-key blocks) and the two-pass
path (``sparse_attn_two_pass.py``, in row chunks): out and lse against an fp64 golden with the
eager reference's error as the yardstick, exact +inf lse / zero out for rows without valid keys
and for the +inf-sink head, and split counts and paths agreeing with each other. The dispatch's
tiling and path choice against explicit expected values. With ``inverse_rope``, every path gives
the bytes of its output rotated back by ``rope_tail``'s kernel (inside the split combine, at every
column tiling of it, or after the attention).
"""

import pytest
import torch

from dsv4_compile.ops.kernels import sparse_attn_combine as combine
from dsv4_compile.ops.kernels import sparse_attn_dispatch as dispatch
from dsv4_compile.ops.kernels import sparse_attn_two_pass as two_pass
from dsv4_compile.ops.kernels.host import num_sms
from dsv4_compile.ops.kernels.norm_rope import launch_rope_tail
from dsv4_compile.ops.kernels.sparse_attn_fused import FusedConfig
from dsv4_compile.reference import sparse_attn as ref
from dsv4_compile.testing.attn_inputs import assert_attn_close, golden_sparse_attn, make_attn_inputs

CASES = {  # name: (extra, extra width)
    "c4": ("c4", 128),
    "c128": ("c128", 64),
    "swa_only": (None, 0),
}


def _inputs(device, extra, extra_width, heads, seed=0):
    return make_attn_inputs(4, heads, extra=extra, swa_width=64, extra_width=extra_width, holes=0.2,
                            ragged=True, sentinels=True, empty_rows=1, invalid_rows=1, special_sink=True,
                            seed=seed, device=device)


def _fused(inp, splits=None, block_n=None):
    """The fused path, with a forced split count and keys per block (None: the dispatch's)."""
    return dispatch.launch_sparse_attn(*inp.args(), path="fused", num_splits=splits, fused=FusedConfig(block_n))


@pytest.mark.parametrize("case, splits", [("c4", 1), ("c4", 3), ("c128", 1), ("c128", 3), ("swa_only", 2)])
def test_matches_reference(device, case, splits):
    extra, width = CASES[case]
    inp = _inputs(device, extra, width, heads=8 if splits == 1 else 16)
    got = _fused(inp, splits, 32 if splits == 1 else 64)
    if device == "cuda":
        torch.cuda.synchronize()
    eager = ref.sparse_attn(*inp.args())
    assert_attn_close(got, eager, golden_sparse_attn(inp), f"{case} splits={splits}")
    out, lse = got
    assert torch.isinf(lse[0]).all() and torch.isinf(lse[-1]).all()  # all -1 / length 0
    assert (out[0] == 0).all() and (out[-1] == 0).all()
    assert (out[:, 0] == 0).all()  # sink +inf


def test_splits_agree(device):
    """Split counts (including more splits than key blocks) give the same result."""
    inp = _inputs(device, "c4", 128, heads=8, seed=1)
    base_out, base_lse = _fused(inp, 1, 64)
    # 7 > 4 key blocks (one combine program per row and head); 40 splits: the combine splits
    # each row's 512 columns over 8 programs to bound its [splits, columns] tile
    # (all results kept alive: a freed output's memory must not be reused by the next launch)
    results = [_fused(inp, splits, 64) for splits in (40, 7)]
    for out, lse in results:
        torch.testing.assert_close(lse, base_lse, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(out.float(), base_out.float(), rtol=2 ** -7, atol=2 ** -7)


@pytest.mark.parametrize("rows, extra_width, tiling", [(1, 128, (16, 32)), (2, 512, (16, 64)), (2, 4096, (64, 32))])
def test_few_rows_tiling(device, rows, extra_width, tiling):
    """One or two rows of 64 heads over a short list run as 16-head programs (``choose_tiling``),
    with 32-key blocks when one block per split covers the list, else 64; a long list keeps
    64-head programs."""
    inp = make_attn_inputs(rows, 64, extra="c4", swa_width=64, extra_width=extra_width, holes=0.2,
                           ragged=True, special_sink=True, seed=2, device=device)
    assert dispatch.choose_tiling(rows, 64, inp.entries_per_row(), num_sms(inp.q.device)) == tiling
    got = _fused(inp)
    if device == "cuda":
        torch.cuda.synchronize()
    assert_attn_close(got, ref.sparse_attn(*inp.args()), golden_sparse_attn(inp), f"rows={rows}")


@pytest.mark.parametrize("case, heads", [("c4", 8), ("c128", 80), ("swa_only", 16)])
def test_two_pass_matches_reference(device, case, heads, monkeypatch):
    """The two-pass kernels (``sparse_attn_two_pass.py``): padded heads (8 of 16), two head blocks
    (80 heads: 64 + 16 of 64), and rows done in chunks of 2 through a small workspace."""
    extra, width = CASES[case]
    inp = _inputs(device, extra, width, heads=heads, seed=3)
    prob_bytes = 4 if device == "cpu" else 2  # fp32 under the interpreter, else bf16
    row_bytes = heads * -(-(64 + width) // 128) * 128 * prob_bytes  # 128-key blocks
    monkeypatch.setattr(two_pass, "_WORKSPACE_BYTES", 2 * row_bytes)
    got = dispatch.launch_sparse_attn(*inp.args(), path="two_pass")
    if device == "cuda":
        torch.cuda.synchronize()
    assert_attn_close(got, ref.sparse_attn(*inp.args()), golden_sparse_attn(inp), f"{case} two-pass")
    out, lse = got
    assert torch.isinf(lse[0]).all() and torch.isinf(lse[-1]).all()  # all -1 / length 0
    assert (out[0] == 0).all() and (out[-1] == 0).all()
    assert (out[:, 0] == 0).all()  # sink +inf


def test_two_pass_agrees_with_fused(device):
    """Both paths agree to bf16 rounding, row by row; int64 index lists give the two-pass result
    bit for bit."""
    inp = _inputs(device, "c4", 128, heads=16, seed=4)
    fused_out, fused_lse = _fused(inp, 1, 64)
    out, lse = dispatch.launch_sparse_attn(*inp.args(), path="two_pass")
    torch.testing.assert_close(lse, fused_lse, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out.float(), fused_out.float(), rtol=2 ** -7, atol=2 ** -7)
    wide = inp.with_int64_indices()
    torch.testing.assert_close(dispatch.launch_sparse_attn(*wide.args(), path="two_pass"), (out, lse), rtol=0, atol=0)


@pytest.mark.parametrize("path, splits, cols", [("fused", 1, None), ("fused", 3, 512), ("fused", 3, 16),
                                                ("two_pass", None, None)])
def test_inverse_rope_is_rope_tail_of_the_output(device, path, splits, cols, monkeypatch):
    """``inverse_rope``: the output rotated back at each row's position, to the bit, as
    ``rope_tail``'s kernel rotates the plain output (in the split combine, at column blocks of
    ``cols``, as many splits make them; no combine at 1 split or on the two-pass path); the lse
    unchanged."""
    if cols is not None:  # the combine's [splits, cols] tile: 4 (3 splits, padded) x cols
        monkeypatch.setattr(combine, "_COMBINE_TILE_ELEMS", 4 * cols)
    inp = _inputs(device, "c4", 128, heads=2, seed=5)
    gen = torch.Generator(device=device).manual_seed(5)
    positions = torch.randint(0, 1 << 17, (inp.q.shape[0],), generator=gen, device=device)
    inv_freq = 10000.0 ** (-torch.arange(0, 64, 2, device=device).float() / 64)
    how = dict(path=path, num_splits=splits, fused=FusedConfig(64))
    out, lse = dispatch.launch_sparse_attn(*inp.args(), **how)
    got, got_lse = dispatch.launch_sparse_attn(*inp.args(), inverse_rope=(positions, inv_freq), **how)
    want = launch_rope_tail(out, positions.unsqueeze(1), inv_freq, inverse=True)
    assert not torch.equal(want, out)
    assert torch.equal(got, want) and torch.equal(got_lse, lse)


# rows, heads, key width -> path with the warp-specialised kernel available / elsewhere (132 SMs)
PATH_CASES = [
    (1, 64, 640, "fused", "fused"),  # one row over a short list: 16-head fused programs
    (32, 64, 640, "warp_specialized", "two_pass"),  # 32 (row, head block) pairs over <= 2048 keys
    (7, 128, 1152, "warp_specialized", "fused"),  # 14 pairs: too few for the two-pass kernels
    (16, 64, 8320, "warp_specialized", "fused"),  # 16 pairs over a long list
    (64, 64, 8320, "warp_specialized", "two_pass"),  # 64 pairs
    (130, 8, 640, "warp_specialized", "two_pass"),  # 8 heads, padded to 64 by the warp-specialised kernel
    (8, 32, 640, "warp_specialized", "fused"),  # 32 heads, 8 (row, head block) pairs
    (2, 16, 640, "fused", "fused"),  # two rows of 16 heads over a short list
]


@pytest.mark.parametrize("rows, heads, width, where_available, elsewhere", PATH_CASES)
def test_choose_path(rows, heads, width, where_available, elsewhere):
    assert dispatch.choose_path(rows, heads, width, 132, warp_specialized=True) == where_available
    assert dispatch.choose_path(rows, heads, width, 132, warp_specialized=False) == elsewhere
