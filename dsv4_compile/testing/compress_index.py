"""Seeded inputs and checks for ``dsv4::compress_kv``, ``dsv4::indexer_prepare_q`` and
``dsv4::indexer_topk`` (tests and benchmarks).

Factories take a ``torch.Generator`` on the target device. Indexer caches come in two kinds:
``store_index_k`` of Gaussian keys (what the compressor writes; small tests) and raw random fp8
codes with random scales (fast to build at 1M-token capacity; benchmarks). Page tables are drawn
from a shuffled pool (fragmented pages, page 0 reserved).

Selection regret: with fp64 logits ``L`` of the visible entries, a top-k set
``S`` has boundary regret ``max(0, max_{j not in S} L_j - min_{j in S} L_j)``; an exact top-k has 0.

Shape legend: T = rows, H = indexer heads, NP = pages per row, K = topk, Wc = coff * d.
"""

from __future__ import annotations

import torch

from .. import layout
from ..config import INDEX_HEAD_DIM, DSV4AttnConfig
from ..reference import compressor as ref_compressor
from ..reference import indexer as ref_indexer
from ..reference import metadata as ref_meta
from ..reference.functional import hadamard, rms_norm, rope_tail
from ..reference.kv_store import gather_index_k, store_index_k
from ..reference.quant import index_page_views
from ..rope import layer_inv_freq

CONFIG = DSV4AttnConfig.from_name("flash")
_PAGES_PER_FILL = 1 << 14  # random_index_cache fills 16k pages (537 MB of fp32 draws) at a time


def compressor_args(ratio: int, d: int, seq_lens, extend_lens, gen: torch.Generator, *,
                    num_tokens: int | None = None, ring: int | None = None, rotate: bool | None = None
                    ) -> dict:
    """Keyword arguments of ``compress_kv`` for one step of requests on rows ``1..B``.

    seq_lens / extend_lens: post-step lengths and tokens this step per request; ``num_tokens``
    (default ``sum(extend_lens)``) adds padding rows. The ring holds random earlier tokens
    ``[kv | score + ape]``; ring default: the config's (16 for c4, 256 for c128).
    """
    device = gen.device
    seq = torch.as_tensor(seq_lens, dtype=torch.int32, device=device)
    ext = torch.as_tensor(extend_lens, dtype=torch.int32, device=device)
    b = seq.shape[0]
    t = int(ext.sum()) if num_tokens is None else num_tokens
    req_rows = torch.arange(1, b + 1, dtype=torch.int32, device=device)
    rows = torch.zeros(t, dtype=torch.int64, device=device)  # an out_cache_loc: only its length is read
    req_of_row, seq_causal, extend_start, extend_end, _ = ref_meta.expand_queries(req_rows, seq, ext, rows)
    ring = CONFIG.state_ring(ratio) if ring is None else ring
    wc = (2 if ratio == 4 else 1) * d

    def randn(*shape, scale=1.0):
        return scale * torch.randn(*shape, generator=gen, device=device)

    return dict(state=randn((b + 1) * ring, 2 * wc), kv=randn(t, wc), score=randn(t, wc),
                ape=randn(ratio, wc, scale=0.5), req_of_row=req_of_row, seq_lens_causal=seq_causal,
                extend_start=extend_start, extend_end=extend_end, norm_weight=1 + randn(d, scale=0.1),
                inv_freq=layer_inv_freq(CONFIG, ratio).to(device), ratio=ratio, ring=ring,
                rotate=(d == INDEX_HEAD_DIM) if rotate is None else rotate, eps=CONFIG.rms_norm_eps)


def compressor_golden(args: dict, rows_per_chunk: int = 256) -> torch.Tensor:
    """fp64 entries ``[T, d]`` (CPU) of ``compress_kv(**args)`` without its bf16 rounding points."""
    a = {k: (v.double() if torch.is_tensor(v) and v.is_floating_point() else v) for k, v in args.items()}
    pos = a["seq_lens_causal"].long() - 1
    score_ape = a["score"] + a["ape"][pos % a["ratio"]]
    rows = torch.arange(pos.shape[0], device=pos.device)
    e = torch.cat([ref_compressor._pool_rows(a["state"], a["kv"], score_ape, a["req_of_row"], pos,
                                             a["extend_start"], rows[lo:lo + rows_per_chunk],
                                             a["ratio"], a["ring"], a["norm_weight"].shape[0])
                   for lo in range(0, pos.shape[0], rows_per_chunk)])
    y = rope_tail(rms_norm(e, a["norm_weight"], a["eps"]), pos - a["ratio"] + 1, a["inv_freq"])
    return (hadamard(y).double() if a["rotate"] else y).cpu()


def check_compress_kv(run, args: dict) -> torch.Tensor:
    """Run ``run(**args)`` (kernel or op) and the reference on a copy of the state; assert the
    window-completing rows' entries are three-way close (kernel error <= 2 x the
    reference's error vs the fp64 golden + a floor of 2^-9 x rms), every row is finite, and the
    rings are equal (except the dummy request 0's: every padding row writes its ring row 0, and
    which one lands last is unspecified).
    Returns the reference's state after the call."""
    state_ref = args["state"].clone()
    golden = compressor_golden(args)
    out = run(**args)
    if out.is_cuda:
        torch.cuda.synchronize()
    want = ref_compressor.compress_kv(**dict(args, state=state_ref))
    assert torch.isfinite(out.float()).all()
    rows = (args["seq_lens_causal"] % args["ratio"] == 0).cpu()
    if rows.any():
        got, want, gold = out.float().cpu()[rows], want.float().cpu()[rows], golden[rows]
        err_k, err_e = (got - gold).abs(), (want - gold).abs()
        floor = 2 ** -9 * gold.pow(2).mean().sqrt()
        worst = divmod(int(err_k.argmax()), got.shape[1])
        assert err_k.max() <= 2 * err_e.max() + floor, f"max {err_k.max():.3g} vs {err_e.max():.3g}, {worst}"
        assert err_k.mean() <= 2 * err_e.mean() + floor / 16, f"mean {err_k.mean():.3g} vs {err_e.mean():.3g}"
    ring = args["ring"]
    assert torch.equal(args["state"][ring:], state_ref[ring:]), "state rings differ"
    return state_ref


def indexer_q(num_rows: int, num_heads: int, gen: torch.Generator,
              dtype: torch.dtype = torch.bfloat16) -> tuple[torch.Tensor, torch.Tensor]:
    """Raw indexer queries ``[T, H, 128]`` and head weights ``[T, H]`` (mixed signs), ``dtype``."""
    device = gen.device
    q = torch.randn(num_rows, num_heads, INDEX_HEAD_DIM, generator=gen, device=device)
    w = torch.randn(num_rows, num_heads, generator=gen, device=device)
    return q.to(dtype), w.to(dtype)


def page_table(num_rows: int, num_pages: int, pool_pages: int, gen: torch.Generator) -> torch.Tensor:
    """``[T, NP] int32`` distinct pages per row drawn from ``1..pool_pages-1``."""
    perm = torch.stack([torch.randperm(pool_pages - 1, generator=gen, device=gen.device)[:num_pages]
                        for _ in range(num_rows)])
    return (perm + 1).to(torch.int32)


def gaussian_index_cache(pool_pages: int, gen: torch.Generator) -> torch.Tensor:
    """``[pool_pages, 8448] uint8`` with every entry a quantised Gaussian key (page 0 included)."""
    cache = torch.zeros(pool_pages, layout.index_page_bytes(), dtype=torch.uint8, device=gen.device)
    n = pool_pages * layout.INDEX_PAGE_SIZE
    keys = torch.randn(n, INDEX_HEAD_DIM, generator=gen, device=gen.device)
    store_index_k(cache, torch.arange(n, device=gen.device), keys, layout.INDEX_PAGE_SIZE)
    return cache


def random_index_cache(pool_pages: int, gen: torch.Generator) -> torch.Tensor:
    """``[pool_pages, 8448] uint8`` built without the quantiser (fast at 1M-token capacities):
    fp8 codes of ``N(0, 64^2)`` values and scales in ``[2^-9, 2^-8)``."""
    device = gen.device
    cache = torch.empty(pool_pages, layout.index_page_bytes(), dtype=torch.uint8, device=device)
    vals, scales = index_page_views(cache)
    for p0 in range(0, pool_pages, _PAGES_PER_FILL):
        chunk = vals[p0:p0 + _PAGES_PER_FILL]
        codes = 64 * torch.randn(chunk.shape, generator=gen, device=device)
        chunk.copy_(codes.clamp(-layout.FP8_MAX, layout.FP8_MAX).to(torch.float8_e4m3fn).view(torch.uint8))
    scales.copy_((1 + torch.rand(scales.shape, generator=gen, device=device)) / 512)
    return cache


def indexer_topk_args(visible, num_heads: int, num_pages: int, topk: int, gen: torch.Generator, *,
                      pool_pages: int | None = None, gaussian: bool = True) -> dict:
    """Keyword arguments of ``indexer_topk``: one row per entry of ``visible`` (at position
    ``4 * visible``), queries prepared by the reference, distinct pages per row from a pool of
    ``pool_pages`` (default: twice what the rows need)."""
    device = gen.device
    vis = torch.as_tensor(visible, dtype=torch.int32, device=device)
    rows = vis.shape[0]
    pool = pool_pages or 2 * rows * num_pages + 1
    cache = gaussian_index_cache(pool, gen) if gaussian else random_index_cache(pool, gen)
    positions = 4 * vis
    q, w = indexer_q(rows, num_heads, gen)
    inv_freq = layer_inv_freq(CONFIG, 4).to(device)
    q_fp8, w = ref_indexer.indexer_prepare_q(q, w, positions, inv_freq, CONFIG.index_weight_scale)
    return dict(q_fp8=q_fp8, w=w, index_cache=cache, page_table=page_table(rows, num_pages, pool, gen),
                visible=vis, topk=topk)


def _row_keys(index_cache: torch.Tensor, page_table: torch.Tensor, r: int) -> torch.Tensor:
    """Dequantised keys ``[NP * 64, 128]`` float64 of every entry row ``r``'s page table addresses."""
    page = layout.INDEX_PAGE_SIZE
    j = torch.arange(page_table.shape[1] * page, device=page_table.device)
    slots = page_table[r].long()[j // page] * page + j % page
    return gather_index_k(index_cache, slots, page).double()


def row_logits64(args: dict, r: int) -> tuple[torch.Tensor, float]:
    """``[NP * 64]`` float64 logits of row ``r`` of ``indexer_topk(**args)``, ``-inf`` past visible,
    and the row's rounding scale ``max_j kappa_j sum_h |w_h| sum_d |q_hd k_jd|`` (float)."""
    keys = _row_keys(args["index_cache"], args["page_table"], r)
    q, w = args["q_fp8"][r].double(), args["w"][r].double().unsqueeze(1)  # [H, 128], [H, 1]
    logits = (w * (q @ keys.t()).relu()).sum(0)
    scale = (w.abs() * (q.abs() @ keys.abs().t())).sum(0).max()
    visible = torch.arange(logits.shape[0], device=logits.device) < args["visible"][r].long()
    return torch.where(visible, logits, float("-inf")), float(scale)


def plant_topk_margin(args: dict, row: int, budget_rel: float, factor: float = 8.0) -> None:
    """Give row ``row`` of ``indexer_topk(**args)`` (``visible > topk``) a top-k set that stands
    apart: its ``topk`` best entries take the fp8 codes of its best entry and ``factor`` times that
    entry's scale, so their logits are ``factor`` times the row's largest. Asserts the margin at
    the K-th logit then exceeds ``budget_rel`` x the row's rounding scale (``check_topk``)."""
    page = layout.INDEX_PAGE_SIZE
    logits, _ = row_logits64(args, row)
    top = logits.topk(args["topk"]).indices
    pages, offsets = args["page_table"][row].long()[top // page], top % page
    vals, scales = index_page_views(args["index_cache"])
    best_page, best_off = pages[0], offsets[0]
    assert logits[top[0]] > 0, "the row's largest logit must be positive"
    vals[pages, offsets] = vals[best_page, best_off].clone()
    scales[pages, offsets] = factor * scales[best_page, best_off].clone()
    logits, scale = row_logits64(args, row)
    ranked = logits.topk(args["topk"] + 1).values
    assert ranked[-2] - ranked[-1] > budget_rel * scale, "planted margin below the budget"


def slots_to_entries(selected: torch.Tensor, page_table: torch.Tensor) -> list[list[int]]:
    """Visible-entry indices ``j`` of each row's selected c4 slots (``-1`` dropped; unknown slots
    map to ``-1`` so that invariant checks can catch them)."""
    rows = []
    for r in range(selected.shape[0]):
        pages = {int(p): i for i, p in enumerate(page_table[r].tolist())}
        row = []
        for s in selected[r].tolist():
            if s >= 0:
                i = pages.get(s // layout.INDEX_PAGE_SIZE)
                row.append(-1 if i is None else i * layout.INDEX_PAGE_SIZE + s % layout.INDEX_PAGE_SIZE)
        rows.append(row)
    return rows


def check_topk_invariants(selected: torch.Tensor, page_table: torch.Tensor, visible: torch.Tensor,
                          topk: int) -> list[list[int]]:
    """int32 ``[T, K]``; valid slots first then -1; no duplicates; only visible entries; exactly
    ``min(visible, K)`` selected. Returns the selected entry indices per row."""
    assert selected.dtype == torch.int32 and selected.shape == (page_table.shape[0], topk)
    entries = slots_to_entries(selected.cpu(), page_table.cpu())
    for r, (row, n) in enumerate(zip(entries, visible.tolist())):
        got = selected[r].cpu()
        count = int((got >= 0).sum())
        assert torch.all(got[count:] == -1), f"row {r}: -1 padding is not a suffix"
        assert count == min(max(n, 0), topk), f"row {r}: {count} selected, visible {n}, topk {topk}"
        assert len(set(row)) == len(row), f"row {r}: duplicate entries"
        assert all(0 <= j < n for j in row), f"row {r}: entry outside the visible prefix {n}"
    return entries


def boundary_regret(logits64: torch.Tensor, entries: list[int]) -> float:
    """fp64 boundary regret of selecting ``entries`` from one row's logits (``-inf`` = invisible)."""
    sel = torch.zeros(logits64.shape[0], dtype=torch.bool, device=logits64.device)
    sel[torch.as_tensor(entries, dtype=torch.long, device=logits64.device)] = True
    visible = torch.isfinite(logits64)
    if not bool((visible & ~sel).any()):
        return 0.0
    return max(0.0, float(logits64[visible & ~sel].max() - logits64[sel].min()))


def check_topk(args: dict, got: torch.Tensor, budget_rel: float) -> int:
    """Check ``got = indexer_topk(**args)`` against the reference: invariants on
    every row; rows with ``visible <= K`` equal the reference (all visible entries, in order);
    other rows have an fp64 boundary regret <= the reference's + ``budget_rel`` x the row's rounding
    scale, and the exact top-k set where the fp64 margin at the K-th logit exceeds that budget.
    Returns the number of rows checked for the exact set."""
    topk, visible = args["topk"], args["visible"]
    want = ref_indexer.indexer_topk(**args)
    entries = check_topk_invariants(got, args["page_table"], visible.cpu(), topk)
    want_entries = slots_to_entries(want.cpu(), args["page_table"].cpu())
    exact_rows = 0
    for r, n in enumerate(visible.tolist()):
        if n <= topk:
            assert torch.equal(got[r], want[r]), f"row {r}: visible {n} <= K must take all, in order"
            continue
        logits, scale = row_logits64(args, r)
        budget = budget_rel * scale
        regret, eager = boundary_regret(logits, entries[r]), boundary_regret(logits, want_entries[r])
        assert regret <= eager + budget, f"row {r}: regret {regret:.3g} > eager {eager:.3g} + {budget:.3g}"
        top = logits[:n].topk(topk + 1).values
        if top[topk - 1] - top[topk] > budget:
            exact_rows += 1
            assert set(entries[r]) == set(want_entries[r]), f"row {r}: top-k sets differ"
    return exact_rows
