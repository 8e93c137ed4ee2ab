"""Out-of-range indices against every op that reads or writes through an index
(docs/semantics.md §6, "Out-of-range indices"): inputs, guard buffers and checks, shared by the
reference, interpreter and GPU tests.

Every buffer an op reads or writes by index is a slice of a larger buffer whose head and tail
("guard" rows) hold poison: random bytes, NaN or values that would show in the outputs if read.
A case runs one op through ``impl``, an object holding op functions by name with the ops'
signatures — ``torch.ops.dsv4`` (the reference on the CPU, the CUDA kernels on the GPU) or
:func:`launchers` (the Triton launchers, for the interpreter) — then asserts that the guards are
byte-identical and that out-of-range entries read as "no entry". It returns what the op produced,
on the CPU, so a test can also compare two implementations.
"""

from __future__ import annotations

import types
from collections.abc import Callable

import torch

from dsv4_compile import layout
from dsv4_compile.config import PAGE_SIZE, SWA_WINDOW
from dsv4_compile.metadata_chain import CHAIN_OPS, named, run_chain
from dsv4_compile.reference import compressor as ref_compressor
from dsv4_compile.reference import indexer as ref_indexer
from dsv4_compile.reference import kv_store as ref_kv
from dsv4_compile.reference import metadata as ref_meta
from dsv4_compile.reference.quant import index_page_views
from dsv4_compile.testing import cache_inputs, compress_index

GUARD = 2  # guard rows (pages, request rows, ring rows of a request) on each side
BIG = 1 << 40  # an int64 index far past every buffer


def launchers() -> types.SimpleNamespace:
    """The Triton launchers under their ops' names (imported on use: they need Triton)."""
    from dsv4_compile.ops.kernels import compressor, indexer, kv_cache, metadata
    fns = {op: getattr(metadata, f"launch_{op}") for op in (*CHAIN_OPS, "step_metadata")}
    return types.SimpleNamespace(**fns, store_kv=kv_cache.launch_store_kv, dequant_kv=kv_cache.launch_dequant_kv,
                                 store_index_k=kv_cache.launch_store_index_k,
                                 compress_kv=compressor.launch_compress_kv,
                                 compress_kv_store=compressor.launch_compress_kv_store,
                                 indexer_topk=indexer.launch_indexer_topk)


def references() -> types.SimpleNamespace:
    """The reference functions under their ops' names (any device)."""
    fns = {op: getattr(ref_meta, op) for op in (*CHAIN_OPS, "step_metadata")}
    return types.SimpleNamespace(**fns, store_kv=ref_kv.store_model1, store_index_k=ref_kv.store_index_k,
                                 dequant_kv=lambda c, s, p: ref_kv.gather_model1(c, s, p).to(torch.bfloat16),
                                 compress_kv=ref_compressor.compress_kv, indexer_topk=ref_indexer.indexer_topk)


def _gen(device, seed: int) -> torch.Generator:
    return torch.Generator(device=device).manual_seed(seed)


def _bytes(t: torch.Tensor) -> torch.Tensor:
    """The bytes of ``t`` (NaN payloads compare as bytes)."""
    return t.detach().contiguous().cpu().view(-1).view(torch.uint8)


def guarded(buf: torch.Tensor, head: int, tail: int) -> tuple[torch.Tensor, Callable[[], None]]:
    """Rows ``head : len - tail`` of ``buf`` (what the op is given) and a check that the other rows
    of ``buf`` hold exactly what they hold now."""
    n = buf.shape[0] - head - tail
    saved = buf.clone()

    def check() -> None:
        for part, name in ((slice(0, head), "head"), (slice(head + n, None), "tail")):
            changed = _bytes(buf[part]) != _bytes(saved[part])
            assert not changed.any(), f"{int(changed.sum())} guard bytes changed in the {name}"
    return buf[head:head + n], check


def _mixed(good: torch.Tensor, bad: list[int], gen: torch.Generator, dtype: torch.dtype) -> torch.Tensor:
    """``good`` and ``bad`` indices in a seeded shuffled order, as ``dtype``."""
    both = torch.cat([good.long(), torch.tensor(bad, dtype=torch.int64, device=good.device)])
    return both[torch.randperm(both.shape[0], generator=gen, device=good.device)].to(dtype)


def _bad_slots(capacity: int, page_size: int, dtype: torch.dtype) -> list[int]:
    """Slots outside ``[0, capacity)``: negative, just past the end, a page past it, far past it."""
    far = torch.iinfo(torch.int32).max if dtype == torch.int32 else BIG
    return [-1, -page_size - 3, capacity, capacity + 5, capacity + page_size + 1, far, -far]


# -- cache writes and reads ----------------------------------------------------------------------
def _store_case(impl, device, op: str, page_size: int, page_bytes: int, keys, reference, slot_dtype) -> None:
    """``impl.<op>(cache, slots, k, page_size)`` on a 3-page slice of random bytes with slots
    outside the slice among in-range ones: the slice equals the reference's store of the in-range
    rows alone, the guard pages are untouched. The first row writes the last slot of the slice's
    page 0, where a skipped row must not undo it."""
    gen = _gen(device, page_size + len(op))
    pages = 3
    buf = torch.randint(0, 256, (pages + 2 * GUARD, page_bytes), generator=gen, device=device, dtype=torch.uint8)
    cache, check = guarded(buf, GUARD, GUARD)
    good = cache_inputs.distinct_slots(4, pages, page_size, gen)
    slots = _mixed(good, _bad_slots(pages * page_size, page_size, slot_dtype), gen, slot_dtype)
    slots = torch.cat([slots.new_tensor([page_size - 1]), slots])
    k = keys(slots.shape[0], gen)
    valid = ((slots >= 0) & (slots < pages * page_size)).cpu()
    want = cache.to("cpu", copy=True)
    reference(want, slots.cpu()[valid], k.cpu()[valid], page_size)
    getattr(impl, op)(cache, slots, k, page_size)
    check()
    assert torch.equal(cache.cpu(), want), f"{op}: the slice differs from a store of the in-range rows"


def store_kv_case(impl, device, page_size: int, slot_dtype=torch.int64) -> None:
    _store_case(impl, device, "store_kv", page_size, layout.model1_page_bytes(page_size),
                cache_inputs.model1_keys, ref_kv.store_model1, slot_dtype)


def store_index_k_case(impl, device, slot_dtype=torch.int64) -> None:
    page = layout.INDEX_PAGE_SIZE
    _store_case(impl, device, "store_index_k", page, layout.index_page_bytes(page),
                lambda n, gen: cache_inputs.index_keys(n, torch.float32, gen), ref_kv.store_index_k, slot_dtype)


def dequant_kv_case(impl, device, page_size: int) -> torch.Tensor:
    """Reads through out-of-range slots are zero rows, though every guard page holds keys."""
    gen = _gen(device, page_size)
    pages = 3
    buf = torch.zeros(pages + 2 * GUARD, layout.model1_page_bytes(page_size), dtype=torch.uint8, device=device)
    every = torch.arange(buf.shape[0] * page_size, device=device)
    ref_kv.store_model1(buf, every, cache_inputs.model1_keys(every.shape[0], gen), page_size)
    cache, check = guarded(buf, GUARD, GUARD)
    good = cache_inputs.distinct_slots(4, pages, page_size, gen)
    slots = _mixed(good, _bad_slots(pages * page_size, page_size, torch.int64), gen, torch.int64)
    got = impl.dequant_kv(cache, slots, page_size).cpu()
    check()
    valid = ((slots >= 0) & (slots < pages * page_size)).cpu()
    assert not got[~valid].any(), "out-of-range slots must read zeros"
    want = ref_kv.gather_model1(cache.cpu(), slots.cpu()[valid], page_size).to(torch.bfloat16)
    assert torch.equal(got[valid], want)
    return got


# -- metadata --------------------------------------------------------------------------------------
def _bad_requests(rows: int) -> list[int]:
    return [-1, rows, rows + 3, -rows - 1, torch.iinfo(torch.int32).max]


def page_table_case(impl, device) -> torch.Tensor:
    """Rows of request rows outside ``req_to_page`` read no page (all 0); the guard rows, full of
    page ids, are never read."""
    gen = _gen(device, 11)
    rows, n_pages = 4, 4
    buf = torch.randint(1, 1000, (rows + 2 * GUARD, n_pages), generator=gen, device=device, dtype=torch.int32)
    req_to_page, check = guarded(buf, GUARD, GUARD)
    req = torch.tensor([1, *_bad_requests(rows), 3, 0], dtype=torch.int32, device=device)
    seq = torch.full_like(req, n_pages * PAGE_SIZE)
    seq[-2] = 300  # a partial row: pages 0 and 1
    got = impl.build_page_table(req_to_page, req, seq).cpu()
    check()
    live = torch.arange(n_pages) * PAGE_SIZE < seq.cpu().long().unsqueeze(1)
    for q, r in enumerate(req.tolist()):
        want = req_to_page[r].cpu() if 0 <= r < rows else torch.zeros(n_pages, dtype=torch.int32)
        assert torch.equal(got[q], torch.where(live[q], want, 0)), (q, r, got[q])
    return got


def _swa_expected(req_to_token, full_to_swa, req, seq, loc) -> dict[str, torch.Tensor]:
    """``build_swa_metadata``'s fields by the letter of docs/semantics.md §3.4, §3.7, §6 (CPU)."""
    rows, l_max, n_full = req_to_token.shape[0], req_to_token.shape[1], full_to_swa.shape[0]
    indices = torch.full((req.shape[0], SWA_WINDOW), -1, dtype=torch.int32)
    out_loc = torch.full((req.shape[0],), -1, dtype=torch.int32)
    for q, (r, s, f) in enumerate(zip(req.tolist(), seq.tolist(), loc.tolist())):
        if not 0 <= r < rows:
            continue
        for k in range(SWA_WINDOW):
            p = s - 1 - k
            full = int(req_to_token[r, p]) if 0 <= p < l_max else -1
            if 0 <= full < n_full:
                indices[q, k] = full_to_swa[full]
        if 0 <= f < n_full:
            out_loc[q] = full_to_swa[f]
    return dict(swa_indices=indices, swa_lengths=seq.clamp_max(SWA_WINDOW).to(torch.int32), swa_out_loc=out_loc)


def swa_metadata_case(impl, device) -> dict[str, torch.Tensor]:
    """Request rows outside ``req_to_token``, positions past ``L_max``, full slots outside
    ``full_to_swa`` (in the map and as out slots): all read as -1; guards never read."""
    gen = _gen(device, 12)
    rows, l_max, n_full = 4, 512, 6 * PAGE_SIZE
    tok = torch.randint(0, n_full, (rows + 2 * GUARD, l_max), generator=gen, device=device, dtype=torch.int32)
    req_to_token, check_tok = guarded(tok, GUARD, GUARD)
    f2s = torch.randint(1, 1 << 20, (n_full + 2 * GUARD,), generator=gen, device=device, dtype=torch.int32)
    full_to_swa, check_f2s = guarded(f2s, GUARD, GUARD)
    req_to_token[1, 195:200] = torch.tensor([torch.iinfo(torch.int32).max, n_full + 100, n_full, -7, -1],
                                            dtype=torch.int32, device=device)
    req = torch.tensor([1, -1, rows, 2, -rows - 1, 3, 3], dtype=torch.int32, device=device)
    seq = torch.tensor([200, 100, 100, l_max + 10, 5, 130, 0], dtype=torch.int32, device=device)
    loc = torch.tensor([7, 9, -1, n_full, -300, BIG, n_full - 1], dtype=torch.int64, device=device)
    got = named([t.cpu() for t in impl.build_swa_metadata(req_to_token, full_to_swa, req, seq, loc)],
                "build_swa_metadata")
    check_tok()
    check_f2s()
    want = _swa_expected(req_to_token.cpu(), full_to_swa.cpu(), req.cpu(), seq.cpu(), loc.cpu())
    for name, w in want.items():
        assert torch.equal(got[name], w), (name, got[name], w)
    return got


def compressed_out_loc_case(impl, device) -> dict[str, torch.Tensor]:
    """Rows that each complete a c4 and a c128 window at an in-range out slot: those of request
    rows outside ``[0, R)`` (negative, R, far past it) get -1 out slots, so they store no entry;
    the others ``slot // r``. The other fields do not depend on the request row."""
    rows = 4
    req = torch.tensor([1, -1, rows, 3, -rows - 1, torch.iinfo(torch.int32).max, 0], dtype=torch.int32,
                       device=device)
    seq = torch.full_like(req, 2 * 128)
    loc = 5 * PAGE_SIZE + 255 + torch.arange(req.shape[0], dtype=torch.int64, device=device) * PAGE_SIZE
    page_table = torch.arange(req.shape[0] * 2, dtype=torch.int32, device=device).view(-1, 2) + 1
    got = {name: t.cpu() for name, t in {
        **named(impl.build_c4_metadata(req, seq, loc, 64, rows), "build_c4_metadata"),
        **named(impl.build_c128_metadata(page_table, req, seq, loc, rows), "build_c128_metadata")}.items()}
    known = ((req >= 0) & (req < rows)).cpu()
    for field, ratio in (("c4_out_loc", 4), ("c128_out_loc", 128)):
        assert torch.equal(got[field], torch.where(known, loc.cpu() // ratio, -1).to(torch.int32)), (field, got[field])
    for field in ("c4_visible", "c4_topk_lengths", "c128_lengths"):
        assert (got[field] == got[field][0]).all(), field
    return got


def _bad_step(device, req_to_token: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """A step of four requests — rows 1 and 2 real, -1 and ``R`` out of range — whose row at
    position 255 of request 1 (it completes a c4 and a c128 window) has out slot -1, and whose
    out-of-range requests carry request 3's slots; two padding rows. Returns the step tensors."""
    rows = req_to_token.shape[0]
    req_rows = torch.tensor([1, -1, rows, 2], dtype=torch.int32, device=device)
    seq = torch.tensor([256, 128, 300, 384], dtype=torch.int32, device=device)
    ext = torch.tensor([2, 1, 2, 1], dtype=torch.int32, device=device)
    pos = [254, 255, 127, 298, 299, 383]
    src = [1, 1, 3, 3, 3, 2]  # request 3's slots for the out-of-range requests
    loc = torch.zeros(len(pos) + 2, dtype=torch.int64, device=device)
    loc[:len(pos)] = req_to_token[torch.tensor(src, device=device), torch.tensor(pos, device=device)].long()
    loc[1] = -1
    return req_rows, seq, ext, loc


def step_metadata_case(impl, device) -> dict[str, torch.Tensor]:
    """Every field of a step with negative out slots and out-of-range request rows, through the
    five ops and the fused one (equal), with guard rows around the index maps: a row with a
    negative out slot stores nothing (its three out slots are -1); a row of an out-of-range
    request reads no page, no window and writes nothing (its three out slots are -1 too, though
    it completes c4 and c128 windows at another request's slots)."""
    gen = _gen(device, 13)
    rows, l_max = 4, 512
    tok, f2s = cache_inputs.index_maps(rows - 1, l_max, gen)
    tok_buf = torch.cat([tok[1:1 + GUARD], tok, tok[1:1 + GUARD]])  # guard rows: live slots of real rows
    req_to_token, check_tok = guarded(tok_buf, GUARD, GUARD)
    page_buf = ref_meta.page_map(tok_buf)
    req_to_page, check_page = guarded(page_buf, GUARD, GUARD)
    full_to_swa, check_f2s = guarded(torch.cat([f2s[1:1 + GUARD], f2s, f2s[1:1 + GUARD]]), GUARD, GUARD)
    step = _bad_step(device, req_to_token)
    chain = run_chain(impl, *step, req_to_token, req_to_page, full_to_swa, 64)
    fused = named(impl.step_metadata(*step, req_to_token, req_to_page, full_to_swa, 64))
    for check in (check_tok, check_page, check_f2s):
        check()
    for name in fused:
        assert torch.equal(chain[name].cpu(), fused[name].cpu()), name
    got = {name: t.cpu() for name, t in fused.items()}
    assert [got[f][1].item() for f in ("swa_out_loc", "c4_out_loc", "c128_out_loc")] == [-1, -1, -1]
    bad = (got["req_of_row"] < 0) | (got["req_of_row"] >= rows)
    assert bad.tolist() == [False, False, True, True, True, False, False, False]
    assert (got["swa_indices"][bad] == -1).all() and (got["swa_out_loc"][bad] == -1).all()
    assert (got["page_table"][bad] == 0).all()
    assert all((got[f][bad] == -1).all() for f in ("c4_out_loc", "c128_out_loc")), \
        (got["c4_out_loc"], got["c128_out_loc"])
    assert got["c4_out_loc"][5] >= 0 and got["c128_out_loc"][5] >= 0  # the real row at position 383
    return got


# -- compressor ------------------------------------------------------------------------------------
def compress_kv_store_case(impl, device, d: int) -> None:
    """``impl.compress_kv_store`` of a c4 verify step (d = 512: MODEL1 tokens, d = 128: indexer
    keys) on a 3-page slice of random bytes, slots outside the slice among in-range ones: the slice
    holds what ``impl.compress_kv``'s entries written by ``impl``'s cache write hold, the guard pages
    are untouched, and the ring is ``compress_kv``'s."""
    gen = _gen(device, d)
    page_size, pages = 4, 3
    model1 = d == 512
    page_bytes = layout.model1_page_bytes(page_size) if model1 else layout.index_page_bytes(page_size)
    buf = torch.randint(0, 256, (pages + 2 * GUARD, page_bytes), generator=gen, device=device, dtype=torch.uint8)
    cache, check = guarded(buf, GUARD, GUARD)
    bad = _bad_slots(pages * page_size, page_size, torch.int64)
    slots = _mixed(cache_inputs.distinct_slots(11 - len(bad), pages, page_size, gen), bad, gen, torch.int64)
    args = compress_index.compressor_args(4, d, [7, 12, 20], [4, 4, 3], gen, ring=16)
    state = args["state"].clone()
    want = cache.clone()
    (impl.store_kv if model1 else impl.store_index_k)(want, slots, impl.compress_kv(**dict(args, state=state)),
                                                      page_size)
    impl.compress_kv_store(**args, cache=cache, slots=slots, page_size=page_size)
    check()
    assert torch.equal(cache, want), "compress_kv_store: the slice differs from the entries' store"
    assert torch.equal(args["state"], state), "compress_kv_store: the ring differs from compress_kv's"


def compress_kv_bad_rows_case(run: Callable[[dict], torch.Tensor], device, ratio: int) -> torch.Tensor:
    """``run(args)`` = ``compress_kv(**args)`` (c4: d = 128, ring 16; c128: d = 512, ring 128) on
    four requests reading earlier tokens from the ring, two of them on request rows -1 and ``R``,
    with the state between NaN guard rings: those two write no ring row and read none (the guards,
    and every ring row but the two real requests', are unchanged; every output is finite)."""
    gen = _gen(device, ratio)
    d, ring = (128, 16) if ratio == 4 else (512, 128)
    seq, ext = ([8, 16, 12, 20], [1, 4, 1, 3]) if ratio == 4 else ([128, 256, 256, 129], [1, 2, 1, 2])
    args = compress_index.compressor_args(ratio, d, seq, ext, gen, ring=ring)
    rows = args["state"].shape[0] // ring  # requests 1..4 on rows 1..4: the real ones keep 1 and 2
    req = args["req_of_row"]
    args["req_of_row"] = torch.where(req == 3, -1, torch.where(req == 4, rows, req))
    nan = torch.full((GUARD * ring, args["state"].shape[1]), float("nan"), device=device)
    args["state"], check = guarded(torch.cat([nan, args["state"], nan]), GUARD * ring, GUARD * ring)
    before = args["state"].clone()
    out = run(args)
    check()
    others = torch.ones(rows * ring, dtype=torch.bool, device=device)
    others[ring:3 * ring] = False
    assert torch.equal(_bytes(args["state"][others]), _bytes(before[others])), "a ring row of no real request changed"
    assert torch.isfinite(out.float()).all(), "an out-of-range request read a NaN ring row"
    return out.cpu()


def compress_kv_ring_beside_skipped_rows_case(run: Callable[[dict], torch.Tensor], device) -> None:
    """``run(args)`` = ``compress_kv(**args)`` on two c4 prefills (ring 16) on request rows 0 and
    1, then a row of request row -1: request 0's 16 tokens fill its whole ring (the last one its
    last ring row), request 1's first 8 tokens are too old for its ring and the last row is
    skipped. Every ring row of both requests holds its token's ``[kv | score + ape]`` after the
    call: no skipped row undoes a write."""
    gen = _gen(device, 15)
    ring = 16
    args = compress_index.compressor_args(4, 128, [16, 24], [16, 24], gen, ring=ring, num_tokens=41)
    req = args["req_of_row"]  # 1, 2 and the padding row's
    args["req_of_row"] = torch.where(req > 0, req - 1, -1)
    args["req_of_row"][-1] = -1
    kv, score = args["kv"], args["score"]
    pos = args["seq_lens_causal"].long() - 1
    rows = torch.cat([torch.arange(16), torch.arange(24, 40)]).to(device)  # the kept tokens, request by request
    want = torch.cat([kv, score + args["ape"][pos % 4]], dim=1)[rows]
    run(args)
    got = args["state"][:2 * ring][torch.cat([pos[:16] % ring, ring + pos[24:40] % ring])]
    assert torch.equal(got, want), "a skipped row undid a ring write"


def compress_kv_masked_nan_case(impl, device) -> torch.Tensor:
    """NaN in ring rows that only masked slots (positions before 0) map to changes nothing: two c4
    prefills from position 0 whose whole ring is NaN, and a decode at position 3 whose ring rows
    past its three earlier tokens are NaN; outputs equal those with zeros there, and are finite."""
    gen = _gen(device, 14)
    args = compress_index.compressor_args(4, 128, [8, 4, 4], [8, 4, 1], gen, ring=16)
    stale = torch.zeros(args["state"].shape[0], dtype=torch.bool, device=device)
    stale[16:48] = True  # requests 1 and 2: never read (every window token is in the step)
    stale[48 + 3:64] = True  # request 3: positions 0..2 are read from the ring, the rest never
    clean = dict(args, state=torch.where(stale.unsqueeze(1), 0.0, args["state"]))
    poisoned = dict(args, state=torch.where(stale.unsqueeze(1), float("nan"), args["state"]))
    want = impl.compress_kv(**clean)
    got = impl.compress_kv(**poisoned)
    assert torch.isfinite(got.float()).all(), "a masked slot's NaN reached the output"
    assert torch.equal(got.cpu(), want.cpu())
    return got.cpu()


def int64_past_int32_case(impl, device) -> None:
    """int64 index values past int32's range are out of range, not wrapped onto an in-range value
    (the metadata outputs are int32): a request row of 2^32 + 1 expands to -1 and a length of 2^33
    saturates; an out slot of 2^34 + 20 writes no compressed entry; a page of 2^62 + 3 or below
    -2^31 gives no c128 entry, and one of 2^40 in ``req_to_page`` no page; a compressor row of
    request row 2^60 + 2 reads no ring row (its entry equals that of request row -1)."""
    i64 = dict(dtype=torch.int64, device=device)
    top = torch.iinfo(torch.int32).max
    req, seq, *_ = impl.expand_queries(torch.tensor([2**32 + 1, 1], **i64), torch.tensor([40, 2**33], **i64),
                                       torch.ones(2, **i64), torch.zeros(2, **i64))
    assert req.tolist() == [-1, 1] and seq.tolist() == [40, top]
    one = torch.ones(1, **i64)
    c4_out, *_ = impl.build_c4_metadata(one, 4 * one, torch.tensor([2**34 + 20], **i64), 64, 3)
    assert c4_out.tolist() == [-1]
    pages = torch.tensor([[2**62 + 3, -2**31 - 5, 7]], **i64)
    _, c128, _ = impl.build_c128_metadata(pages, one, 768 * one, -one, 3)
    assert c128[0, :6].tolist() == [-1, -1, -1, -1, 14, 15]
    table = impl.build_page_table(torch.tensor([[2**40, 7]], **i64), 0 * one, 512 * one)
    assert table.tolist() == [[0, 7]]
    args = compress_index.compressor_args(4, 128, [8, 8], [1, 1], _gen(device, 16), ring=16)  # 3 ring rows
    far, off = dict(args, state=args["state"].clone()), dict(args, state=args["state"].clone())
    far["req_of_row"] = torch.full_like(args["req_of_row"], 2**60 + 2, dtype=torch.int64)
    off["req_of_row"] = torch.full_like(args["req_of_row"], -1)
    assert torch.equal(impl.compress_kv(**far), impl.compress_kv(**off))


# -- indexer ----------------------------------------------------------------------------------------
_TOPK_PAGES = 6  # pages of the index cache slice


def _positive_index_cache(device, gen) -> tuple[torch.Tensor, Callable[[], None]]:
    """An index cache slice of positive keys (every logit of a positive query is > 0) between
    guard pages whose keys and scales are huge (read, they would win every selection)."""
    buf = torch.zeros(_TOPK_PAGES + 2 * GUARD, layout.index_page_bytes(), dtype=torch.uint8, device=device)
    vals, scales = index_page_views(buf)
    codes = 0.5 + 1.5 * torch.rand(vals.shape, generator=gen, device=device)
    vals.copy_(codes.to(torch.float8_e4m3fn).view(torch.uint8))
    scales.copy_(1 + torch.rand(scales.shape, generator=gen, device=device))
    vals[:GUARD] = vals[-GUARD:] = 0x7E  # e4m3 448
    scales[:GUARD] = scales[-GUARD:] = 1e30
    return guarded(buf, GUARD, GUARD)


def _topk_args(device, page_table: list[list[int]], visible: list[int], topk: int, seed: int):
    gen = _gen(device, seed)
    cache, check = _positive_index_cache(device, gen)
    rows, heads = len(visible), 8
    q = torch.ones(rows, heads, 128, device=device).to(torch.float8_e4m3fn)
    w = 0.5 + torch.rand(rows, heads, generator=gen, device=device)
    return dict(q_fp8=q, w=w, index_cache=cache, page_table=torch.tensor(page_table, dtype=torch.int32, device=device),
                visible=torch.tensor(visible, dtype=torch.int32, device=device), topk=topk), check


def _entry_slots(pages: list[int], n: int) -> list[int]:
    """The slot of each entry ``j < n`` (-1 on a page outside the cache slice)."""
    page = layout.INDEX_PAGE_SIZE
    return [pages[j // page] * page + j % page if 0 <= pages[j // page] < _TOPK_PAGES else -1 for j in range(n)]


def indexer_topk_case(impl, device, narrow: bool) -> torch.Tensor:
    """Page tables pointing outside the index cache (negative, past it, far past it) and visible
    counts past the page table: entries on such pages read as zero keys and come out as -1, rows
    with ``visible <= topk`` list every entry in order, the others pick the ``topk`` best in-range
    entries; ``narrow``: a page table of two pages under a top-k of 192 (no row is scored)."""
    far = torch.iinfo(torch.int32).max
    n = _TOPK_PAGES
    if narrow:
        tables, visible, topk = [[1, n], [-1, 2], [3, 4]], [500, 100, -3], 192
    else:  # topk 128 of a 256-entry page table
        tables = [[-1, 3, n, 2], [n + 1, -2, 1, 2], [4, far, 5, 1], [2, 3, 4, 5], [1, -1, -1, -1]]
        visible, topk = [100, 300, 200, -3, 70], 128
    args, check = _topk_args(device, tables, visible, topk, 15 + narrow)
    got = impl.indexer_topk(**args).cpu()
    check()
    cap = len(tables[0]) * layout.INDEX_PAGE_SIZE
    for r, (pages, vis) in enumerate(zip(tables, visible)):
        slots = _entry_slots(pages, min(max(vis, 0), cap))
        if len(slots) <= topk:
            assert got[r].tolist() == slots + [-1] * (topk - len(slots)), f"row {r}"
            continue
        chosen = got[r].tolist()
        assert len(set(chosen)) == topk and set(chosen) <= set(slots) - {-1}, f"row {r}: {sorted(chosen)}"
    return got
