"""Benchmark cases of ``compress_kv``, ``indexer_prepare_q`` and ``indexer_topk`` for
``bench_ops.py`` (imported there when present; ``cases(args)`` returns :class:`bench_ops.Case`).

Usage: ``python benchmarks/bench_ops.py --only compressor indexer`` (see bench_ops.py), e.g.
``python benchmarks/bench_ops.py --only indexer_logits --capacity 131072 1048576 --batch 256``.

Cases, for every ``b`` in ``--batch`` (decode: one row per request):

* ``compress_kv`` c4 attention (d 512), c4 indexer (d 128 + Hadamard), c128 (d 512): b decode
  rows at random positions (about b / r complete a window); target <= 5 µs at b = 256.
  Also ``compress_kv_prefill``: one 4096-row prefill per compressor (64 rows under --device cpu).
* ``indexer_prepare_q``: b rows x 64 heads.
* ``indexer_logits`` (the scan alone) and ``indexer_topk`` (scan + select), for every capacity
  in ``--capacity`` (tokens per request, 1M = 262144 c4 entries): every request at full length,
  so each row scans ``capacity / 4`` entries; K = 512. Target: scan >= 60% of HBM bandwidth at
  >= 128k. All cases share one random-code index cache sized for the largest b x capacity.

Byte counts (HBM traffic the GB/s uses): compress_kv reads kv + score (2 x 4 Wc B per row),
writes the ring (8 Wc B per row) and the entry (2 d B), and each window-completing row reads
its ring slots (S x 2 x 4 d B at most); prepare_q reads q (bf16) and weights and writes fp8 q and
fp32 w; the scan reads 132 B per visible entry (128 fp8 + fp32 scale) and writes a 4 B logit;
topk adds the select's reads of the logits (three 4 B passes) and the output. The reference is
timed only up to 2^22 scanned entries (it gathers fp32 keys: seconds per call beyond).
"""

from __future__ import annotations

from functools import partial

import torch
from bench_ops import Case

from dsv4_compile import layout
from dsv4_compile.config import INDEX_HEAD_DIM
from dsv4_compile.ops.kernels import compressor as comp_kernels
from dsv4_compile.ops.kernels import indexer as index_kernels
from dsv4_compile.reference import compressor as ref_comp
from dsv4_compile.reference import indexer as ref_index
from dsv4_compile.rope import layer_inv_freq
from dsv4_compile.testing import compress_index as inputs

HEADS = 64
TOPK = 512
COMPRESSORS = (("c4_attn", 4, 512), ("c4_index", 4, INDEX_HEAD_DIM), ("c128", 128, 512))
_REFERENCE_MAX_ENTRIES = 1 << 22


def _compress_bytes(args) -> int:
    ratio, d = args["ratio"], args["norm_weight"].shape[0]
    wc = args["kv"].shape[1]
    rows = args["kv"].shape[0]
    windows = int((args["seq_lens_causal"] % ratio == 0).sum())
    return rows * (16 * wc + 2 * d + 16) + windows * ref_comp.window_slots(ratio) * 8 * d


def _compress_case(name, args, params) -> Case:
    return Case(name, params, family="compressor", bytes=_compress_bytes(args),
                kernel=partial(comp_kernels.launch_compress_kv, **args),
                reference=partial(ref_comp.compress_kv, **args),
                notes="target <= 5 us at b=256 decode" if name == "compress_kv" else "")


def compressor_cases(args) -> list[Case]:
    cases = []
    prefill_rows = 4096 if args.device == "cuda" else 64
    for label, ratio, d in COMPRESSORS:
        for b in args.batch:
            gen = torch.Generator(device=args.device).manual_seed(b)
            seq = torch.randint(1, 1 << 20, (b,), generator=gen, device=args.device).tolist()
            cargs = inputs.compressor_args(ratio, d, seq, [1] * b, gen)
            cases.append(_compress_case("compress_kv", cargs, {"b": b, "compressor": label}))
        gen = torch.Generator(device=args.device).manual_seed(ratio + d)
        cargs = inputs.compressor_args(ratio, d, [prefill_rows], [prefill_rows], gen)
        cases.append(_compress_case("compress_kv_prefill", cargs, {"T": prefill_rows, "compressor": label}))
    return cases


def prepare_q_cases(args) -> list[Case]:
    cases = []
    inv_freq = layer_inv_freq(inputs.CONFIG, 4).to(args.device)
    scale = inputs.CONFIG.index_weight_scale
    for b in args.batch:
        gen = torch.Generator(device=args.device).manual_seed(b)
        q, w = inputs.indexer_q(b, HEADS, gen)
        pos = torch.randint(0, 1 << 20, (b,), generator=gen, device=args.device, dtype=torch.int32)
        op_args = (q, w, pos, inv_freq, scale)
        cases.append(Case("indexer_prepare_q", {"b": b}, family="indexer",
                          bytes=b * HEADS * (2 * INDEX_HEAD_DIM + 2 + INDEX_HEAD_DIM + 4),
                          kernel=partial(index_kernels.launch_indexer_prepare_q, *op_args),
                          reference=partial(ref_index.indexer_prepare_q, *op_args)))
    return cases


def _scan(q_fp8, w, cache, page_table, visible, topk, ws, minmax):
    index_kernels.launch_indexer_logits(q_fp8, w, cache, page_table, visible, topk, ws, minmax)


def topk_cases(args) -> list[Case]:
    """indexer_logits / indexer_topk for every (b, capacity) on one shared cache."""
    cases = []
    page_tokens = 4 * layout.INDEX_PAGE_SIZE  # tokens per c4 index page
    max_pages = max(args.batch) * max(args.capacity) // page_tokens
    gen = torch.Generator(device=args.device).manual_seed(0)
    cache = inputs.random_index_cache(max_pages + 1, gen)
    inv_freq = layer_inv_freq(inputs.CONFIG, 4).to(args.device)
    weight_scale = inputs.CONFIG.index_weight_scale
    for capacity in args.capacity:
        num_pages = capacity // page_tokens
        entries = num_pages * layout.INDEX_PAGE_SIZE
        for b in args.batch:
            q, w = inputs.indexer_q(b, HEADS, gen)
            visible = torch.full((b,), entries, dtype=torch.int32, device=args.device)
            q_fp8, w = ref_index.indexer_prepare_q(q, w, 4 * visible, inv_freq, weight_scale)
            pt = inputs.page_table(b, num_pages, max_pages + 1, gen)
            op_args = (q_fp8, w, cache, pt, visible, TOPK)
            scanned = b * entries
            ref_logits = partial(ref_index.indexer_logits, *op_args[:4])
            with_ref = scanned <= _REFERENCE_MAX_ENTRIES
            params = {"b": b, "capacity": capacity, "topk": TOPK}
            ws, minmax = index_kernels.indexer_workspace(b, entries, args.device)
            if ws.shape[0] == b:  # the scan alone, when one workspace chunk holds every row
                cases.append(Case("indexer_logits", params, family="indexer",
                                  bytes=scanned * (layout.INDEX_ENTRY_BYTES + 4),
                                  kernel=partial(_scan, *op_args, ws, minmax),
                                  reference=ref_logits if with_ref else None,
                                  notes="target >= 60% of HBM at >= 128k"))
            cases.append(Case("indexer_topk", params, family="indexer",
                              bytes=scanned * (layout.INDEX_ENTRY_BYTES + 16) + 4 * b * TOPK,
                              kernel=partial(index_kernels.launch_indexer_topk, *op_args),
                              reference=partial(ref_index.indexer_topk, *op_args) if with_ref else None))
    return cases


def cases(args) -> list[Case]:
    return compressor_cases(args) + prepare_q_cases(args) + topk_cases(args)
