"""Per-row top-k selection over an fp32 logits workspace, mapped to c4 slots (the second half of
``dsv4::indexer_topk``; the logits come from ``indexer.py::_logits_kernel``).

Row ``q`` has ``n = min(visible[q], capacity)`` logits ``workspace[q, :n]``. Output ``out[q, :K]``:
``slot(j) = page_table[q, j // 64] * 64 + j % 64`` for the selected ``j``, -1 padded; -1 as well
for an entry whose page is outside the index cache (``num_pages`` pages, docs/semantics.md §6).
Everything is decided per row on the device:

* ``n <= K``: every visible ``j`` in order (no logits read), then -1s (``_radix_select_kernel``).
* ``n > K``, three passes (a bucket select, then an exact radix select on the bucket):
  1. ``_bucket_hist_kernel`` (grid ``[T, S2]``, each program one contiguous chunk of the row):
     256-bin histogram of ``bucket(x) = floor((x - lo) * 256 / (hi - lo))`` (monotone in ``x``;
     ``lo`` / ``hi`` = the row's min / max recorded by the logits scan), bins stored highest first.
  2. ``_bucket_emit_kernel`` (same grid): from the summed histograms, the bucket ``b*`` holding the
     K-th largest logit, the count ``above`` of logits in higher buckets, and this chunk's write
     offsets (prefix over earlier chunks). Emits the slots of logits in higher buckets to
     ``out[q, :above]`` and compacts the indices ``j`` in bucket ``b*`` to ``cand[q, :]``
     (one packed ``cumsum`` gives both positions).
  3. ``_radix_select_kernel`` (grid ``[T]``): exact radix select of the ``K - above`` largest among the
     candidates: four 8-bit histogram passes over the order-preserving int32 key of the float
     (``bits ^ ((bits >> 31) & 0x7fffffff)``) find the threshold key; emit keys above it and the
     first ties up to K into ``out[q, above:K]``.
  The candidate bucket is small for smooth logit distributions (about n / 256 times the density at
  the threshold); ties or outliers only make step 3 longer, never wrong. Total work O(n) per row,
  spread over ``S2`` programs for the two full passes.
* Rows of at most ``_ROW_SELECT_MAX_CAPACITY`` entries (the page table's width; 8k tokens of
  context at ratio 4): ``_row_select_kernel`` (grid ``[T]``) keeps the row's keys in registers
  and finds the K-th largest with four 8-bit histogram passes over all of them (no bucket pass,
  no candidate list), then emits the selected slots with one ``cumsum``: one launch and one read
  of the row, where the split passes pay three dependent launches and several memory round
  trips. Its passes are a loop, not unrolled: in a model step the kernel runs once per CSA layer
  with its instructions out of cache, and on the H200 the unrolled passes (8.5k PTX lines at
  4 warps) took 19.5 µs a call there against 11.3 standalone; looped (3.3k lines at 8 warps),
  10.1 against 10.8 (``benchmarks/bench_model.py --profile``, b = 1, 1,056 entries, K = 512).
* Decode-sized steps (few rows of at most ``_RANK_SELECT_MAX_CAPACITY`` entries):
  ``_rank_select_kernel`` (grid ``[T, capacity / BLOCK_I]``) counts, for each visible entry, the
  visible entries ahead of it in the row's order (key descending, index ascending) and writes the
  slot of each entry ranked below K to ``out[q, rank]``: the selected slots in that order, no
  program waiting on another. Its O(n^2) comparisons spread one row over the GPU, where the
  one-program select leaves all but one SM idle (CSA layer of the model step, b = 1: 10 -> ~4
  µs), and cover the visible entries only, so a row's cost follows its context, not its capacity.

Shape legend: T = rows of this chunk, capacity = page-table width * 64, K = topk, S = scan splits,
S2 = select splits, NB = 256 buckets.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ... import layout
from .primitives import unsigned_key

_NB = 256
_BLOCK = 1024  # logits per select iteration (< 2**16: packed cumsum)
_SELECT_PROGRAMS = 256
_MAX_SELECT_SPLITS = 64
# Rows of at most this many entries run the whole select in one program (``_row_select_kernel``),
# their logits held in registers. H200, ``indexer_topk`` µs (scan included) at b = 1 / 32 / 256,
# one program against the split passes: 2048 entries 14.6 / 16.1 / 40.2 against 18.7 / 21.3 /
# 49.6; 4096 entries 17.8 / 29.7 / 71.9 against 19.4 / 23.3 / 79.9 (its four full-row histograms
# cost more than the split passes' one once the row is long).
_ROW_SELECT_MAX_CAPACITY = 2048
_DIGIT_BITS = 8  # threshold bits a histogram pass of the one-program select finds (4 passes)
# Decode-sized steps rank every entry against its whole row in parallel (``_rank_select_kernel``):
# rows x visible^2 comparisons over programs of _RANK_BLOCK_I entries, each comparing them with
# _RANK_BLOCK_J keys at a time, for rows of at most _RANK_SELECT_MAX_CAPACITY entries while rows x
# capacity^2 stays within _RANK_SELECT_MAX_COMPARISONS. H100, select µs at K = 512 for 1,024 / 2,048
# visible logits of rows of 2,048, ranked against one program a row: 1 row 2.6 / 4.1 against 10.6;
# 4 rows 4.8 / 9.8 against 10.6 / 10.7; 8 rows 7.2 / 17.0 against 10.7 / 10.8; 16 rows 9.8 / 31.6
# against 10.7 / 10.8. (Ranked over the whole tile of 2,048, whatever was visible, it took 3.5 / 3.9
# for one row, 16.3 / 16.7 for 8.)
_RANK_SELECT_MAX_CAPACITY = 2048
_RANK_SELECT_MAX_COMPARISONS = 1 << 24
_RANK_BLOCK_I = 8
_RANK_BLOCK_J = 1024
_RANK_WARPS = 4
# The launcher's limits that force each path (tests and benchmarks pin a path with them).
PATH_LIMITS = {"rank": {"_RANK_SELECT_MAX_COMPARISONS": 1 << 62},
               "row": {"_RANK_SELECT_MAX_COMPARISONS": 0, "_ROW_SELECT_MAX_CAPACITY": 1 << 62},
               "split": {"_RANK_SELECT_MAX_CAPACITY": 0, "_ROW_SELECT_MAX_CAPACITY": 0}}


def _row_select_warps(cap: int) -> int:
    """Warps of the one-program select of rows of ``cap`` (a power of two) logits."""
    return min(16, max(4, cap // 256))


@triton.jit
def _row_range(mm_ptr, r, num_splits, S_P2: tl.constexpr, NB: tl.constexpr):
    """(lo, scale) of the row's buckets: ``bucket(x) = (x - lo) * scale``, scale 0 for flat rows."""
    s = tl.arange(0, S_P2)
    base = mm_ptr + (r * num_splits + s).to(tl.int64) * 2
    lo = tl.min(tl.load(base, mask=s < num_splits, other=float("inf")), axis=0)
    hi = tl.max(tl.load(base + 1, mask=s < num_splits, other=float("-inf")), axis=0)
    return lo, tl.where(hi > lo, NB / tl.where(hi > lo, hi - lo, 1.0), 0.0)


@triton.jit
def _rev_bucket(x, lo, scale, NB: tl.constexpr):
    """Bucket index counted from the top (0 = largest logits)."""
    b = ((x - lo) * scale).to(tl.int32)
    return NB - 1 - tl.minimum(tl.maximum(b, 0), NB - 1)


@triton.jit
def _chunk(n, split, num_sel, BLOCK: tl.constexpr):
    size = tl.cdiv(tl.cdiv(n, num_sel), BLOCK) * BLOCK
    start = split * size
    return start, tl.minimum(start + size, n)


@triton.jit
def _threshold_bin(hist, need, NB: tl.constexpr):
    """Index ``i`` of the bin holding the ``need``-th element (bins ordered highest first) and the
    count of elements in bins before it."""
    cum = tl.cumsum(hist, 0)
    i = tl.sum((cum < need).to(tl.int32), 0)
    return i, tl.sum(tl.where(tl.arange(0, NB) < i, hist, 0), 0)


@triton.jit
def _bucket_offsets(hist_ptr, r, num_sel, split, topk, NB: tl.constexpr):
    """Threshold bucket ``b*`` of row ``r`` (from all splits' histograms) and the counts of logits
    above it / in it within the splits before ``split`` (= the chunk's write offsets)."""
    base = hist_ptr + (r * num_sel).to(tl.int64) * NB
    bins = tl.arange(0, NB)
    total = tl.zeros([NB], dtype=tl.int32)
    for s in range(0, num_sel):
        total += tl.load(base + s * NB + bins)
    b_star, _ = _threshold_bin(total, topk, NB)
    before = tl.zeros([NB], dtype=tl.int32)
    for s in range(0, split):
        before += tl.load(base + s * NB + bins)
    above = tl.sum(tl.where(bins < b_star, before, 0), 0)
    return b_star, above, tl.sum(tl.where(bins == b_star, before, 0), 0)


@triton.jit
def _slot(pt_row, j, mask, num_pages, PAGE: tl.constexpr):
    """c4 slots of entries ``j`` (page table row ``pt_row``); -1 on pages outside ``[0, num_pages)``."""
    return _slot_on_page(tl.load(pt_row + j // PAGE, mask=mask, other=-1), j, num_pages, PAGE)


@triton.jit
def _slot_on_page(page, j, num_pages, PAGE: tl.constexpr):
    """c4 slots of entries ``j`` whose page-table entries are ``page``: -1 on pages outside ``[0,
    num_pages)``."""
    page = page.to(tl.int64)
    return tl.where((page >= 0) & (page < num_pages), page * PAGE + j % PAGE, -1).to(tl.int32)


@triton.jit
def _visible_count(vis_ptr, row, capacity):
    """``n = min(visible[row], capacity)``, at least 0: the logits row ``row`` selects among."""
    return tl.minimum(tl.maximum(tl.load(vis_ptr + row).to(tl.int32), 0), capacity)


@triton.jit
def _select_row(vis_ptr, pt_ptr, out_ptr, row, capacity, stride_pt, stride_out):
    """``(n, page-table row, output row)`` of row ``row`` of the step."""
    row = row.to(tl.int64)
    return _visible_count(vis_ptr, row, capacity), pt_ptr + row * stride_pt, out_ptr + row * stride_out


@triton.jit
def _bucket_hist(workspace_row, start, end, lo, scale, NB: tl.constexpr, BLOCK: tl.constexpr):
    """256-bin histogram (highest bucket first) of the logits ``workspace_row[start:end]``."""
    hist = tl.zeros([NB], dtype=tl.int32)
    for j0 in range(start, end, BLOCK):
        j = j0 + tl.arange(0, BLOCK)
        x = tl.load(workspace_row + j, mask=j < end, other=0.0)
        hist += tl.histogram(_rev_bucket(x, lo, scale, NB), NB, mask=j < end)
    return hist


@triton.jit
def _emit_bucket(workspace_row, cand_row, pt_row, out_row, start, end, lo, scale, b_star, off_above, off_cand,
                 num_pages, NB: tl.constexpr, BLOCK: tl.constexpr, PAGE: tl.constexpr):
    """Of the logits ``[start, end)``: slots of those in buckets above ``b_star`` to
    ``out_row[off_above:]``, indices of those in ``b_star`` to ``cand_row[off_cand:]``; returns both
    offsets advanced."""
    for j0 in range(start, end, BLOCK):
        j = j0 + tl.arange(0, BLOCK)
        rb = _rev_bucket(tl.load(workspace_row + j, mask=j < end, other=0.0), lo, scale, NB)
        is_above = (j < end) & (rb < b_star)
        is_cand = (j < end) & (rb == b_star)
        pos = tl.cumsum(is_above.to(tl.int32) + (is_cand.to(tl.int32) << 16), 0)  # inclusive, packed
        slot = _slot(pt_row, j, is_above, num_pages, PAGE)
        tl.store(out_row + off_above + (pos & 0xFFFF) - 1, slot, mask=is_above)
        tl.store(cand_row + off_cand + (pos >> 16) - 1, j, mask=is_cand)
        off_above += tl.sum(is_above.to(tl.int32), 0)
        off_cand += tl.sum(is_cand.to(tl.int32), 0)
    return off_above, off_cand


@triton.jit
def _bucket_hist_kernel(workspace_ptr, mm_ptr, vis_ptr, hist_ptr, row0, capacity, topk, num_splits, num_sel,
                        stride_workspace, S_P2: tl.constexpr, NB: tl.constexpr, BLOCK: tl.constexpr,
                        PDL: tl.constexpr):
    if PDL:  # the scan's logits are final past the wait; the emit kernel may launch
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    r = tl.program_id(0)
    split = tl.program_id(1)
    n = _visible_count(vis_ptr, row0 + r, capacity)
    if n > topk:
        lo, scale = _row_range(mm_ptr, r, num_splits, S_P2, NB)
        start, end = _chunk(n, split, num_sel, BLOCK)
        hist = _bucket_hist(workspace_ptr + r.to(tl.int64) * stride_workspace, start, end, lo, scale, NB, BLOCK)
        tl.store(hist_ptr + (r * num_sel + split).to(tl.int64) * NB + tl.arange(0, NB), hist)


@triton.jit
def _bucket_emit_kernel(workspace_ptr, mm_ptr, vis_ptr, hist_ptr, pt_ptr, out_ptr, cand_ptr, row0, capacity,
                        num_pages, topk, num_splits, num_sel, stride_workspace, stride_pt, stride_out,
                        S_P2: tl.constexpr, NB: tl.constexpr, BLOCK: tl.constexpr, PAGE: tl.constexpr,
                        PDL: tl.constexpr):
    if PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    r = tl.program_id(0)
    split = tl.program_id(1)
    row = (row0 + r).to(tl.int64)
    n = _visible_count(vis_ptr, row, capacity)
    if n > topk:
        lo, scale = _row_range(mm_ptr, r, num_splits, S_P2, NB)
        b_star, off_above, off_cand = _bucket_offsets(hist_ptr, r, num_sel, split, topk, NB)
        start, end = _chunk(n, split, num_sel, BLOCK)
        _emit_bucket(workspace_ptr + r.to(tl.int64) * stride_workspace, cand_ptr + r.to(tl.int64) * stride_workspace,
                     pt_ptr + row * stride_pt, out_ptr + row * stride_out, start, end, lo, scale, b_star, off_above,
                     off_cand, num_pages, NB, BLOCK, PAGE)


@triton.jit
def _ordered_key(x):
    """int32 key with the order of the fp32 values (for finite values and ±inf)."""
    bits = x.to(tl.int32, bitcast=True)
    return bits ^ ((bits >> 31) & 0x7FFFFFFF)


@triton.jit
def _digit_hist(key, match, prefix, level: tl.constexpr, NB: tl.constexpr):
    """256-bin histogram (highest digit first) of digit ``level`` (8 bits, 0 = most significant)
    of the keys ``match``-ing whose higher digits equal ``prefix``."""
    if level == 0:
        digit = (key >> 24) + 128  # signed top byte -> [0, 256)
    else:
        shift: tl.constexpr = 24 - 8 * level
        digit = (key >> shift) & 0xFF
        match = match & ((key >> (shift + 8)) == prefix)
    return tl.histogram(NB - 1 - digit, NB, mask=match)


@triton.jit
def _narrow(hist, need, prefix, level: tl.constexpr, NB: tl.constexpr):
    """From digit ``level``'s histogram: ``(need, prefix)`` of the ``need``-th largest key, its
    rank among the keys sharing the prefix extended by its digit, and that prefix."""
    i, skipped = _threshold_bin(hist, need, NB)
    return need - skipped, prefix * NB + (NB - 1 - i) - (128 if level == 0 else 0)


@triton.jit
def _take(key, match, threshold, need, ties):
    """The ``match``-ing keys selected: those above ``threshold`` and the first ``need`` equal to
    it, ``ties`` equal ones counted before these; returns the mask and ``ties`` advanced."""
    eq = match & (key == threshold)
    take = (match & (key > threshold)) | (eq & (ties + tl.cumsum(eq.to(tl.int32), 0) <= need))
    return take, ties + tl.sum(eq.to(tl.int32), 0)


@triton.jit
def _select_candidates(workspace_row, cand_row, pt_row, out_row, above, num_cand, topk, num_pages,
                       NB: tl.constexpr, BLOCK: tl.constexpr, PAGE: tl.constexpr):
    """Exact radix select of the ``topk - above`` largest logits among the ``num_cand`` candidates
    ``cand_row``; their slots to ``out_row[above:]``. Returns the count of slots now in ``out_row``."""
    need = topk - above
    prefix = 0
    for level in tl.static_range(4):
        hist = tl.zeros([NB], dtype=tl.int32)
        for c0 in range(0, num_cand, BLOCK):
            c = c0 + tl.arange(0, BLOCK)
            key = _ordered_key(tl.load(workspace_row + tl.load(cand_row + c, mask=c < num_cand, other=0)))
            hist += _digit_hist(key, c < num_cand, prefix, level, NB)
        need, prefix = _narrow(hist, need, prefix, level, NB)
    # prefix is now the threshold key
    filled = above
    ties = tl.zeros_like(need)
    for c0 in range(0, num_cand, BLOCK):
        c = c0 + tl.arange(0, BLOCK)
        j = tl.load(cand_row + c, mask=c < num_cand, other=0)
        take, ties = _take(_ordered_key(tl.load(workspace_row + j)), c < num_cand, prefix, need, ties)
        pos = filled + tl.cumsum(take.to(tl.int32), 0) - 1
        tl.store(out_row + pos, _slot(pt_row, j, take, num_pages, PAGE), mask=take)
        filled += tl.sum(take.to(tl.int32), 0)
    return filled


@triton.jit
def _store_in_order(pt_row, out_row, c, n, topk, num_pages, PAGE: tl.constexpr):
    """A row of ``n <= topk`` visible entries, positions ``c`` of its output: the slot of entry
    ``c`` for ``c < n``, -1 up to ``topk``."""
    tl.store(out_row + c, tl.where(c < n, _slot(pt_row, c, c < n, num_pages, PAGE), -1), mask=c < topk)


@triton.jit
def _finish_row(pt_row, out_row, n, topk, filled, num_pages, BLOCK: tl.constexpr, PAGE: tl.constexpr):
    """``n <= topk``: the slots of every ``j < n`` in order; always: -1 after the last selected."""
    for c0 in range(0, topk, BLOCK):
        c = c0 + tl.arange(0, BLOCK)
        if n <= topk:
            _store_in_order(pt_row, out_row, c, n, topk, num_pages, PAGE)
        else:
            tl.store(out_row + c, tl.full([BLOCK], -1, tl.int32), mask=(c >= filled) & (c < topk))


@triton.jit
def _radix_select_kernel(workspace_ptr, vis_ptr, hist_ptr, pt_ptr, out_ptr, cand_ptr, row0, capacity, num_pages,
                         topk, num_sel, stride_workspace, stride_pt, stride_out, NB: tl.constexpr, BLOCK: tl.constexpr,
                         PAGE: tl.constexpr, PDL: tl.constexpr):
    if PDL:
        tl.extra.cuda.gdc_wait()
    r = tl.program_id(0)
    n, pt_row, out_row = _select_row(vis_ptr, pt_ptr, out_ptr, row0 + r, capacity, stride_pt, stride_out)
    filled = n  # n <= K: every visible entry, in order, unscored
    if n > topk:
        _, above, num_cand = _bucket_offsets(hist_ptr, r, num_sel, num_sel, topk, NB)
        filled = _select_candidates(workspace_ptr + r.to(tl.int64) * stride_workspace,
                                    cand_ptr + r.to(tl.int64) * stride_workspace, pt_row, out_row, above, num_cand,
                                    topk, num_pages, NB, BLOCK, PAGE)
    _finish_row(pt_row, out_row, n, topk, filled, num_pages, BLOCK, PAGE)


@triton.jit
def _kth_largest(key, match, k, DIGIT_BITS: tl.constexpr):
    """The ``k``-th largest of the ``match``-ing uint32 keys (``1 <= k <=`` their count), found from
    its top bits down, ``DIGIT_BITS`` a pass: a pass histograms the next digit of the keys that share
    the bits found so far and keeps the digit of the bin holding the ``k``-th largest. The passes are
    a loop, not unrolled: a kernel that runs once a layer finds its instructions out of cache, and
    the unrolled four passes took twice their standalone time inside a model step."""
    NB: tl.constexpr = 1 << DIGIT_BITS
    k = tl.zeros([], dtype=tl.int32) + k  # a tensor even when Triton passes k = 1 as a constant
    prefix = tl.zeros([], dtype=tl.uint32)
    shift = tl.full([], 32 - DIGIT_BITS, tl.uint32)
    for _ in range(0, 32 // DIGIT_BITS):
        digit = (key - prefix) >> shift  # wraps below the prefix: masked out
        inside = match & (key >= prefix) & (digit < NB)
        bin_from_top = tl.where(inside, NB - 1 - digit.to(tl.int32), 0)
        i, skipped = _threshold_bin(tl.histogram(bin_from_top, NB, mask=inside), k, NB)
        k -= skipped
        prefix += (NB - 1 - i).to(tl.uint32) << shift
        shift -= DIGIT_BITS
    return prefix


@triton.jit
def _row_select_kernel(workspace_ptr, vis_ptr, pt_ptr, out_ptr, row0, capacity, num_pages, topk, stride_workspace,
                       stride_pt, stride_out, CAP: tl.constexpr, BLOCK: tl.constexpr, PAGE: tl.constexpr,
                       DIGIT_BITS: tl.constexpr, PDL: tl.constexpr):
    """A whole row's select in one program (grid ``[T]``), for rows of at most ``CAP`` logits:
    the row's keys and their page-table entries stay in registers while :func:`_kth_largest` finds
    the K-th largest, then one ``cumsum`` places the selected slots, so the only memory round trips
    are one load of the row and its pages and the stores."""
    if PDL:
        tl.extra.cuda.gdc_wait()
    r = tl.program_id(0)
    n, pt_row, out_row = _select_row(vis_ptr, pt_ptr, out_ptr, row0 + r, capacity, stride_pt, stride_out)
    filled = n
    if n > topk:
        j = tl.arange(0, CAP)
        visible = j < n
        key = unsigned_key(tl.load(workspace_ptr + r.to(tl.int64) * stride_workspace + j, mask=visible, other=0.0))
        # every entry's page with the keys: read after the select, it would wait for its passes
        page = tl.load(pt_row + j // PAGE, mask=visible, other=-1)
        threshold = _kth_largest(key, visible, topk, DIGIT_BITS)
        need = topk - tl.sum((visible & (key > threshold)).to(tl.int32), axis=0)
        take, _ = _take(key, visible, threshold, need, 0)
        tl.store(out_row + tl.cumsum(take.to(tl.int32), 0) - 1, _slot_on_page(page, j, num_pages, PAGE), mask=take)
        filled = topk
    _finish_row(pt_row, out_row, n, topk, filled, num_pages, BLOCK, PAGE)


@triton.jit
def _rank_select_kernel(workspace_ptr, vis_ptr, pt_ptr, out_ptr, row0, capacity, num_pages, topk, stride_workspace,
                        stride_pt, stride_out, BLOCK_I: tl.constexpr, BLOCK_J: tl.constexpr, PAGE: tl.constexpr,
                        PDL: tl.constexpr):
    """Entries ``i = [pid(1) BLOCK_I, +BLOCK_I)`` of row ``pid(0)`` (grid ``[T, max(capacity, K) /
    BLOCK_I]``): each visible entry's rank in the row's order (key descending, index ascending),
    counted against the row's visible entries ``BLOCK_J`` at a time; the entries ranked below K are
    the top K, and each writes its slot to ``out[rank]``. No program waits for another, so a decode
    step's row spreads over the GPU instead of one SM; a program whose entries are all past the
    visible ones has nothing to rank and returns."""
    if PDL:
        tl.extra.cuda.gdc_wait()
    r = tl.program_id(0)
    n, pt_row, out_row = _select_row(vis_ptr, pt_ptr, out_ptr, row0 + r, capacity, stride_pt, stride_out)
    i = tl.program_id(1) * BLOCK_I + tl.arange(0, BLOCK_I)
    if n <= topk:
        _store_in_order(pt_row, out_row, i, n, topk, num_pages, PAGE)
    elif tl.program_id(1) * BLOCK_I < n:
        row = workspace_ptr + r.to(tl.int64) * stride_workspace
        # this block's entries and their pages first: the row's keys go through shared memory to
        # their broadcast layout (a warp barrier), and a load after that barrier waits for them
        key_i = unsigned_key(tl.load(row + i, mask=i < n, other=0.0))[:, None]
        page = tl.load(pt_row + i // PAGE, mask=i < n, other=-1)
        rank = tl.zeros([BLOCK_I], dtype=tl.int32)
        for j0 in range(0, n, BLOCK_J):
            j = j0 + tl.arange(0, BLOCK_J)
            key_j = unsigned_key(tl.load(row + j, mask=j < n, other=0.0))[None, :]
            ahead = (key_j > key_i) | ((key_j == key_i) & (j[None, :] < i[:, None]))
            rank += tl.sum((ahead & (j < n)[None, :]).to(tl.int32), axis=1)
        take = (i < n) & (rank < topk)
        tl.store(out_row + rank, _slot_on_page(page, i, num_pages, PAGE), mask=take)


def launch_topk_select(workspace: torch.Tensor | None, minmax: torch.Tensor | None, page_table: torch.Tensor,
                       visible: torch.Tensor, out: torch.Tensor, row0: int, topk: int, capacity: int,
                       num_pages: int, rows: int, pdl: bool = False) -> None:
    """Fill ``out[row0 : row0 + rows]`` from the logits ``workspace [>= rows, capacity] fp32``;
    ``num_pages``: pages of the index cache (slots on other pages come out as -1).

    minmax: [>= rows, S, 2] fp32 per-split min / max of the scan; page_table: [T, NP] int32/int64
    (contiguous); visible: [T]; out: [T, topk] int32. ``workspace`` / ``minmax`` may be None when
    ``capacity <= topk`` (no row is ever scored). ``pdl``: launch the select's kernels with
    programmatic dependent launch (sm_90+; the scan before them triggers its dependents).
    """
    if rows == 0:
        return
    page = layout.INDEX_PAGE_SIZE
    if workspace is None:  # only the n <= K branch can run: placeholders for the unused buffers
        workspace = torch.empty(1, 1, dtype=torch.float32, device=out.device)
        cand, hist = workspace.view(torch.int32), torch.empty(1, 1, _NB, dtype=torch.int32, device=out.device)
        _radix_select_kernel[(rows,)](workspace, visible, hist, page_table, out, cand, row0, capacity, num_pages,
                                      topk, 1,
                                      workspace.stride(0), page_table.stride(0), out.stride(0), NB=_NB,
                                      BLOCK=_BLOCK, PAGE=page, PDL=False, num_warps=4)
        return
    if capacity <= _RANK_SELECT_MAX_CAPACITY and rows * capacity * capacity <= _RANK_SELECT_MAX_COMPARISONS:
        _rank_select_kernel[(rows, triton.cdiv(max(capacity, topk), _RANK_BLOCK_I))](
            workspace, visible, page_table, out, row0, capacity, num_pages, topk, workspace.stride(0),
            page_table.stride(0), out.stride(0), BLOCK_I=_RANK_BLOCK_I, BLOCK_J=_RANK_BLOCK_J, PAGE=page,
            PDL=pdl, num_warps=_RANK_WARPS, launch_pdl=pdl)
        return
    cap = triton.next_power_of_2(capacity)
    if capacity <= _ROW_SELECT_MAX_CAPACITY:
        _row_select_kernel[(rows,)](workspace, visible, page_table, out, row0, capacity, num_pages, topk,
                                    workspace.stride(0), page_table.stride(0), out.stride(0), CAP=cap,
                                    BLOCK=_BLOCK, PAGE=page, DIGIT_BITS=_DIGIT_BITS, PDL=pdl,
                                    num_warps=_row_select_warps(cap), launch_pdl=pdl)
        return
    num_splits = minmax.shape[1]
    s_p2 = triton.next_power_of_2(num_splits)
    cand = torch.empty(workspace.shape, dtype=torch.int32, device=workspace.device)  # workspace's row stride
    num_sel = max(1, min(triton.cdiv(capacity, _BLOCK), triton.cdiv(_SELECT_PROGRAMS, rows),
                         _MAX_SELECT_SPLITS))
    hist = torch.empty(rows, num_sel, _NB, dtype=torch.int32, device=workspace.device)
    # pdl: each kernel launches while the previous one drains and waits for it in-kernel
    common = dict(NB=_NB, BLOCK=_BLOCK, PDL=pdl, num_warps=4, launch_pdl=pdl)
    _bucket_hist_kernel[(rows, num_sel)](workspace, minmax, visible, hist, row0, capacity, topk, num_splits, num_sel,
                                         workspace.stride(0), S_P2=s_p2, **common)
    _bucket_emit_kernel[(rows, num_sel)](workspace, minmax, visible, hist, page_table, out, cand, row0, capacity,
                                         num_pages, topk, num_splits, num_sel, workspace.stride(0),
                                         page_table.stride(0), out.stride(0), S_P2=s_p2, PAGE=page, **common)
    _radix_select_kernel[(rows,)](workspace, visible, hist, page_table, out, cand, row0, capacity, num_pages, topk,
                                  num_sel,
                                  workspace.stride(0), page_table.stride(0), out.stride(0), PAGE=page, **common)
