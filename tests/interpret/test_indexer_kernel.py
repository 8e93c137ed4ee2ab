"""Indexer kernels (``ops/kernels/indexer.py``, ``ops/kernels/topk_select.py``) vs the reference.

``indexer_prepare_q``: fp8 codes within one e4m3 ulp of the reference's (>= 99% identical; the
Hadamard sums in another order) and head weights within a few fp32 ulps, for bf16 / fp32 and
strided inputs.

``indexer_topk``: invariants on every row (int32, -1 padding as a suffix, no
duplicates, only visible entries, exactly ``min(visible, K)`` selected); rows with
``visible <= K`` equal the reference exactly (all visible entries, in order); other rows have an
fp64 boundary regret within the reference's + a reduction budget, and the exact top-k set where
the fp64 margin at the K-th logit exceeds that budget. Extra inputs: logits ordered by distinct
scales (exact sets), all-equal and few-valued logits (ties), several select splits, several
workspace chunks, a capacity below K, int64 index tensors; each through both select paths (one
program per row, and the split passes).
"""

import os

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from dsv4_compile import layout
from dsv4_compile.ops.kernels import indexer as indexer_kernels
from dsv4_compile.ops.kernels import topk_select
from dsv4_compile.reference import indexer as ref
from dsv4_compile.reference.quant import index_page_views
from dsv4_compile.rope import layer_inv_freq
from dsv4_compile.testing import compress_index as inputs

E4M3_MANTISSA_BITS = 3
DEVICE = "cpu" if os.environ.get("TRITON_INTERPRET") == "1" else "cuda"  # hypothesis: no fixture


@pytest.fixture(autouse=True)
def _small_grids(monkeypatch):
    """Toy-sized programs so that several scan splits, select splits and select blocks per row
    occur at toy capacities (and the interpreter, which pays per program, stays fast)."""
    monkeypatch.setattr(indexer_kernels, "_SCAN_PROGRAMS", 16)
    monkeypatch.setattr(topk_select, "_SELECT_PROGRAMS", 16)
    monkeypatch.setattr(topk_select, "_BLOCK", 128)


def _gen(device, seed=0):
    return torch.Generator(device=device).manual_seed(seed)


def _e4m3_ulp(x: torch.Tensor) -> torch.Tensor:
    exp = torch.floor(torch.log2(x.abs().clamp_min(2.0 ** -6)))
    return torch.exp2(exp - E4M3_MANTISSA_BITS)


# -- prepare_q ---------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("num_heads", [8, 20])
def test_prepare_q_matches_reference(device, dtype, num_heads):
    gen = _gen(device, num_heads)
    rows = 5
    q, w = inputs.indexer_q(rows, num_heads + 3, gen, dtype)
    q, w = q[:, 1:num_heads + 1], w[:, 2:num_heads + 2]  # strided views
    positions = torch.tensor([0, 7, 100, 5000, (1 << 20) - 1], dtype=torch.int32, device=device)
    inv_freq = layer_inv_freq(inputs.CONFIG, 4).to(device)
    scale = inputs.CONFIG.index_weight_scale
    q_fp8, w_out = indexer_kernels.launch_indexer_prepare_q(q, w, positions, inv_freq, scale)
    q_ref, w_ref = ref.indexer_prepare_q(q, w, positions, inv_freq, scale)
    assert q_fp8.dtype == torch.float8_e4m3fn and w_out.dtype == torch.float32
    got, want = q_fp8.float(), q_ref.float()
    assert torch.all((got - want).abs() <= _e4m3_ulp(want)), "fp8 codes differ by more than one ulp"
    assert (q_fp8.view(torch.uint8) == q_ref.view(torch.uint8)).float().mean() >= 0.99
    torch.testing.assert_close(w_out, w_ref, rtol=2 ** -16, atol=0)  # sigma: amax of a 128-term sum


# -- topk --------------------------------------------------------------------------------------
GPU_BUDGET_REL = 2.0 ** -10  # Hopper's fp8 MMA accumulation
INTERPRETER_BUDGET_REL = 2.0 ** -16  # fp32 accumulation


def _check_topk(args, got):
    """``check_topk`` with the fp32-accumulation budget here, fp8-MMA budget on the GPU."""
    return inputs.check_topk(args, got, budget_rel=GPU_BUDGET_REL if got.is_cuda else INTERPRETER_BUDGET_REL)


@pytest.mark.usefixtures("select_path")
@pytest.mark.parametrize("topk,num_heads", [(64, 8), (128, 64)])
def test_topk_matches_reference(device, topk, num_heads):
    """Random keys; the last row (every entry visible) gets a top-k set whose margin exceeds the
    GPU's budget, so on every device at least one row is checked for the exact set."""
    num_pages = 12  # capacity 768: two scan splits, up to six select splits of 128 per row
    cap = num_pages * layout.INDEX_PAGE_SIZE
    visible = [0, 1, topk - 1, topk, topk + 1, 3 * topk + 5, cap][::1 if num_heads < 64 else 2]
    args = inputs.indexer_topk_args(visible, num_heads, num_pages, topk, _gen(device, topk))
    inputs.plant_topk_margin(args, len(visible) - 1, GPU_BUDGET_REL)
    exact_rows = _check_topk(args, indexer_kernels.launch_indexer_topk(**args))
    assert exact_rows >= 1, "no row was checked for the exact top-k set"


def _identical_keys(args):
    """Every entry gets the fp8 codes of entry 0 (scales untouched): logits = scale * C."""
    vals, _ = index_page_views(args["index_cache"])
    vals.copy_(vals[0, 0].clone().expand_as(vals))


@pytest.mark.usefixtures("select_path")
@pytest.mark.parametrize("outlier", [False, True])
def test_topk_logits_ordered_by_distinct_scales(device, outlier):
    """Identical keys, distinct scales: the exact top-k set is the largest (or smallest) scales.
    With one outlier scale (1000) every other logit of a row lands in one bucket: the radix
    select then ranks several blocks of distinct candidates."""
    topk, num_pages = 64, 12
    gen = _gen(device, 1)
    args = inputs.indexer_topk_args([300, 700, 768], 8, num_pages, topk, gen)
    _identical_keys(args)
    _, scales = index_page_views(args["index_cache"])
    perm = torch.randperm(scales.numel(), generator=gen, device=device)
    scales.copy_((1 + perm.float() / scales.numel()).view_as(scales))  # distinct, within [1, 2)
    if outlier:  # entry 0 of every row
        scales[args["page_table"][:, 0].long(), 0] = 1000.0
    got = indexer_kernels.launch_indexer_topk(**args)
    _check_topk(args, got)
    want = ref.indexer_topk(**args)
    for r in range(3):  # the margin (1 / pool entries, relative) is below the GPU budget: assert here
        assert set(got[r].tolist()) == set(want[r].tolist())


@pytest.mark.usefixtures("select_path")
@pytest.mark.parametrize("num_values", [1, 3])
def test_topk_ties(device, num_values):
    """All logits equal (a flat row) or only a few distinct values: ties at the threshold."""
    topk, num_pages = 64, 4
    gen = _gen(device, num_values)
    args = inputs.indexer_topk_args([256, 200, 64], 8, num_pages, topk, gen)
    _identical_keys(args)
    _, scales = index_page_views(args["index_cache"])
    choice = torch.randint(0, num_values, scales.shape, generator=gen, device=device)
    scales.copy_(1 + choice.float())
    _check_topk(args, indexer_kernels.launch_indexer_topk(**args))


@pytest.mark.usefixtures("select_path")
def test_topk_workspace_chunks(device, monkeypatch):
    """Rows processed in several workspace chunks give the same selection."""
    topk, num_pages = 64, 4
    args = inputs.indexer_topk_args([256, 100, 255, 130, 3], 8, num_pages, topk, _gen(device, 2))
    whole = indexer_kernels.launch_indexer_topk(**args)
    monkeypatch.setattr(indexer_kernels, "_WORKSPACE_ELEMS", 2 * num_pages * layout.INDEX_PAGE_SIZE)
    assert torch.equal(indexer_kernels.launch_indexer_topk(**args), whole)
    _check_topk(args, whole)


@pytest.mark.usefixtures("select_path")
def test_topk_capacity_below_k(device):
    """Page tables narrower than K: every row takes all its visible entries."""
    args = inputs.indexer_topk_args([0, 5, 64, 128], 8, 2, 192, _gen(device, 3))
    _check_topk(args, indexer_kernels.launch_indexer_topk(**args))


@pytest.mark.usefixtures("select_path")
def test_topk_int64_index_tensors(device):
    args = inputs.indexer_topk_args([70, 200, 10], 8, 4, 64, _gen(device, 4))
    args64 = dict(args, page_table=args["page_table"].long(), visible=args["visible"].long())
    got = indexer_kernels.launch_indexer_topk(**args64)
    assert torch.equal(got, indexer_kernels.launch_indexer_topk(**args))
    _check_topk(args, got)


# -- the select alone ----------------------------------------------------------------------------
def _ordered_slots(logits: torch.Tensor, page_table: torch.Tensor, n: int, topk: int, by_rank: bool = False
                   ) -> list[int]:
    """The exact selection of one row: its ``topk`` largest logits of ``[0, n)`` (-0.0 below +0.0,
    equal ones by index), as slots in index order (``by_rank``: in that order of the logits when
    n > topk), -1 padded to ``topk``."""
    bits = logits[:n].view(torch.int32).long()
    key = torch.where(bits < 0, -bits - (1 << 31) - 1, bits)  # fp32 order, -0.0 below +0.0
    order = sorted(range(n), key=lambda j: (-int(key[j]), j))[:topk] if n > topk else range(n)
    page = layout.INDEX_PAGE_SIZE
    slots = [int(page_table[j // page]) * page + j % page for j in (order if by_rank else sorted(order))]
    return slots + [-1] * (topk - len(slots))


@settings(max_examples=40, deadline=None)
@given(pages=st.integers(1, 5), visible=st.lists(st.integers(0, 5 * 64 + 9), min_size=1, max_size=3),
       topk=st.sampled_from([1, 16, 64, 100]), levels=st.sampled_from([2, 7, 1 << 20]),
       signed_zeros=st.booleans(), path=st.sampled_from(sorted(topk_select.PATH_LIMITS)),
       rank_keys=st.sampled_from([64, topk_select._RANK_BLOCK_J]), seed=st.integers(0, 2 ** 16))
def test_select_takes_the_exact_top_k(pages, visible, topk, levels, signed_zeros, path, rank_keys, seed):
    """``launch_topk_select`` on a given logits workspace, each select path: the K largest of each
    row's visible prefix (ties by index, -0.0 below +0.0) as slots of the row's pages, -1 padded;
    in index order on the one-program path, in the logits' order (ties by index) on the rank path,
    as a set on the split path. ``rank_keys``: keys the rank path compares at a time (64: rows of
    several tiles)."""
    gen = torch.Generator().manual_seed(seed)
    rows, capacity = len(visible), pages * layout.INDEX_PAGE_SIZE
    logits = (torch.randint(0, levels, (rows, capacity), generator=gen) - levels // 2).float() / 3
    if signed_zeros:
        logits[logits == 0] = torch.where(torch.rand(int((logits == 0).sum()), generator=gen) < 0.5, -0.0, 0.0)
    page_table = torch.stack([torch.randperm(rows * pages, generator=gen)[:pages] for _ in range(rows)]).int()
    vis = torch.tensor(visible, dtype=torch.int32)
    minmax = torch.stack([logits.amin(1), logits.amax(1)], -1)[:, None]  # one scan split per row
    out = torch.full((rows, topk), 7, dtype=torch.int32)
    with pytest.MonkeyPatch.context() as patch:
        for name, limit in topk_select.PATH_LIMITS[path].items():
            patch.setattr(topk_select, name, limit)
        patch.setattr(topk_select, "_RANK_BLOCK_J", rank_keys)
        tensors = [t.to(DEVICE) for t in (logits, minmax, page_table, vis, out)]
        topk_select.launch_topk_select(*tensors, row0=0, topk=topk, capacity=capacity, num_pages=rows * pages,
                                       rows=rows)
    got = tensors[-1].cpu()
    for r in range(rows):
        want = _ordered_slots(logits[r], page_table[r], min(visible[r], capacity), topk, by_rank=path == "rank")
        taken = [v for v in want if v >= 0]
        assert got[r, len(taken):].eq(-1).all()  # -1 padding as a suffix
        # the split path writes the slots of higher buckets first, in no order within them
        if path != "split":
            assert got[r].tolist() == want
        else:
            assert sorted(got[r, :len(taken)].tolist()) == sorted(taken)


@pytest.mark.parametrize("path", ["rank", "row"])
@pytest.mark.parametrize("special", [float("inf"), float("-inf")])
def test_select_orders_infinities(device, special, path, monkeypatch):
    """The rank and one-program selects on a row holding infinities among finite logits."""
    for name, limit in topk_select.PATH_LIMITS[path].items():
        monkeypatch.setattr(topk_select, name, limit)
    capacity, topk = 2 * layout.INDEX_PAGE_SIZE, 10
    logits = torch.arange(capacity, dtype=torch.float32).remainder(17)[None]
    logits[0, ::9] = special
    page_table = torch.tensor([[1, 0]], dtype=torch.int32)
    out = torch.empty(1, topk, dtype=torch.int32, device=device)
    topk_select.launch_topk_select(logits.to(device), None, page_table.to(device),
                                   torch.tensor([capacity], dtype=torch.int32, device=device), out, 0, topk,
                                   capacity, 2, 1)
    assert out.cpu()[0].tolist() == _ordered_slots(logits[0], page_table[0], capacity, topk, by_rank=path == "rank")
