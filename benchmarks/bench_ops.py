"""Per-op GPU time of the dsv4 Triton kernels vs their torch references, by CUDA-graph replay.

Usage:
    python benchmarks/bench_ops.py                       # every case, JSON to bench_ops.json
    python benchmarks/bench_ops.py --batch 256 --capacity 1048576 --only metadata
    python benchmarks/bench_ops.py --only compressor indexer
    python benchmarks/bench_ops.py --only experts --batch 1 8 32 256
    python benchmarks/bench_ops.py --only router_topk --batch 1 8 64
    python benchmarks/bench_ops.py --only indexer_logits --capacity 131072 1048576 --batch 256
    python benchmarks/bench_ops.py --cold-l2 --json /tmp/cold.json
    python benchmarks/bench_ops.py --only indexer_topk --select split --batch 1 8 --capacity 4096 8192
    TRITON_INTERPRET=1 python benchmarks/bench_ops.py --dry-run --device cpu --batch 1 4 --capacity 1024

Timing: ``dsv4_compile.testing.bench.graph_us`` (``--inner`` calls captured in one CUDA graph,
the graph replayed ``--iters`` times, the median replay time divided by ``--inner``). By default
the L2 is warm across the inner calls; ``--cold-l2`` writes a 2x-L2 buffer before every call and
subtracts the time of that write alone (noisier; better for large gathers).

Reported per case: kernel and reference µs, bytes moved (each case builder states what it counts),
achieved GB/s and the fraction of the H200's 4.8 TB/s. A summary records the two step budgets:
all metadata ops of a b=256 decode step at 1M tokens per request, as five launches and fused
(``dsv4::step_metadata``) (target <= 10 µs), and ``store_kv`` at b=256 (target <= 5 µs).

Cases, for every ``b`` in ``--batch`` (decode: one row per request unless stated):

* kv_cache: ``store_kv`` (SWA page 256 and c128 page 2), ``dequant_kv``, ``store_index_k``.
* metadata: each metadata op, and all of them chained, at every capacity in ``--capacity``.
* compressor: ``compress_kv`` c4 attention (d 512), c4 indexer (d 128 + Hadamard), c128 (d 512):
  b decode rows at random positions (about b / r complete a window); target <= 5 µs at b = 256.
  Also ``compress_kv_prefill``: one 4096-row prefill per compressor (64 rows under --device cpu).
* indexer: ``indexer_prepare_q`` (b rows x 64 heads); ``indexer_logits`` (the scan alone) and
  ``indexer_topk`` (scan + select) for every capacity (tokens per request, 1M = 262144 c4
  entries): every request at full length, so each row scans ``capacity / 4`` entries; K = 512.
  Target: scan >= 60% of HBM bandwidth at >= 128k. All share one random-code index cache sized
  for the largest b x capacity; the reference is timed only up to 2^22 scanned entries (it
  gathers fp32 keys: seconds per call beyond). ``--select`` forces one path of the select
  (``row`` or ``split``; ``ops/kernels/topk_select.py``) in place of the launcher's choice.
* experts: ``routed_experts`` for b tokens over 8 experts (2 a token, 4 layers' weights cycled)
  and 256 (6 a token), against the grouped GEMMs transformers' ``grouped_mm`` path runs.
* linears: the Flash model's products of one weight at b rows (``o_b_proj``, ``q_b_proj``, the
  shared expert's ``down_proj``, ``lm_head``) through ``dsv4::linears``, and its grouped
  ``o_a_proj`` through ``dsv4::grouped_linear``, against cuBLAS (``x @ w.T``, the ``bmm``); 4
  copies of each weight cycled (one of ``lm_head``, which outsizes the L2 alone). ``q_b_proj
  normed``: the query latent's norm folded into the launch, against the norm, then cuBLAS.
  ``--linear-tiles 32x512x4x4 ...`` times the kernels at each given tile instead of the
  launcher's (``BLOCK_N x BLOCK_K x warps x stages``); ``--expert-tiles`` the same for both expert
  kernels (cases of at most ``MAX_SLOTS`` slots).

Adding cases: a builder is ``fn(args) -> list[Case]`` (``dsv4_compile.testing.bench.Case``)
appended to ``CASE_BUILDERS``.
"""

from __future__ import annotations

import argparse
import json
import sys
from functools import partial
from pathlib import Path
from typing import Callable

import torch
import torch.nn.functional as F
from triton.runtime.errors import OutOfResources

from dsv4_compile import ForwardMode, layout
from dsv4_compile.config import HEAD_DIM, INDEX_HEAD_DIM, PAGE_SIZE, SWA_WINDOW
from dsv4_compile.metadata_chain import FIELDS_BY_NAME, named, run_chain
from dsv4_compile.ops import experts as experts_ops
from dsv4_compile.ops.linear import grouped_linear_reference
from dsv4_compile.ops.kernels import compressor as comp_kernels
from dsv4_compile.ops.kernels import experts as expert_kernels
from dsv4_compile.ops.kernels import indexer as index_kernels
from dsv4_compile.ops.kernels import kv_cache as kv_kernels
from dsv4_compile.ops.kernels import linear as linear_kernels
from dsv4_compile.ops.kernels import metadata as meta_kernels
from dsv4_compile.ops.kernels import topk_select
from dsv4_compile.reference import compressor as ref_comp
from dsv4_compile.reference import indexer as ref_index
from dsv4_compile.reference import kv_store as ref_kv
from dsv4_compile.reference import metadata as ref_meta
from dsv4_compile.rope import layer_inv_freq
from dsv4_compile.testing import cache_inputs as inputs
from dsv4_compile.testing import compress_index
from dsv4_compile.testing.bench import Case, compress_kv_bytes, graph_us

PEAK_GBPS = 4800.0  # H200 HBM3e
INDEX_TOPK = 512
INDEX_HEADS = 64
STEP_BUDGETS = {  # summary key -> (case name, params to match, target µs)
    "decode_metadata_b256_1M": ("decode_metadata_total", {"b": 256, "capacity": 1 << 20}, 10.0),
    "decode_metadata_fused_b256_1M": ("decode_metadata_fused", {"b": 256, "capacity": 1 << 20}, 10.0),
    "store_kv_b256": ("store_kv", {"b": 256, "page": layout.SWA_PAGE_SIZE}, 5.0),
}
COMPRESSORS = (("c4_attn", 4, 512), ("c4_index", 4, INDEX_HEAD_DIM), ("c128", 128, 512))
_REFERENCE_MAX_ENTRIES = 1 << 22


# -- timing ------------------------------------------------------------------------------------
def time_case(fn, args, flush) -> float:
    if not args.cold_l2:
        return graph_us(fn, args.iters, args.inner)
    return graph_us(fn, args.iters, args.inner, flush) - graph_us(lambda: None, args.iters, args.inner, flush)


# -- cache-write cases -------------------------------------------------------------------------
def _dequant_reference(cache, slots, page_size):
    return ref_kv.gather_model1(cache, slots, page_size).to(torch.bfloat16)


def kv_cache_cases(args) -> list[Case]:
    """store_kv (SWA page 256 and c128 page 2), dequant_kv, store_index_k with b rows.

    Bytes: keys read (bf16) + slots read (int64) + packed bytes written (584 per MODEL1 token,
    132 per indexer entry); dequant reads 584 and writes 1024 per row.
    """
    cases = []
    for b in args.batch:
        gen = torch.Generator(device=args.device).manual_seed(b)
        k = inputs.model1_keys(b, gen)
        for page in (layout.SWA_PAGE_SIZE, layout.C128_PAGE_SIZE):
            num_pages = 2 * b // page + 3
            cache = torch.zeros(num_pages, layout.model1_page_bytes(page), dtype=torch.uint8, device=args.device)
            slots = inputs.distinct_slots(b, num_pages, page, gen)
            params = {"b": b, "page": page}
            cases.append(Case("store_kv", params, family="kv_cache",
                              kernel=partial(kv_kernels.launch_store_kv, cache, slots, k, page),
                              reference=partial(ref_kv.store_model1, cache, slots, k, page),
                              bytes=b * (2 * HEAD_DIM + 8 + layout.TOKEN_BYTES)))
            if page == layout.SWA_PAGE_SIZE:
                cases.append(Case("dequant_kv", params, family="kv_cache",
                                  kernel=partial(kv_kernels.launch_dequant_kv, cache, slots, page),
                                  reference=partial(_dequant_reference, cache, slots, page),
                                  bytes=b * (8 + layout.TOKEN_BYTES + 2 * HEAD_DIM)))
        page = layout.INDEX_PAGE_SIZE
        num_pages = 2 * b // page + 3
        cache = torch.zeros(num_pages, layout.index_page_bytes(page), dtype=torch.uint8, device=args.device)
        slots = inputs.distinct_slots(b, num_pages, page, gen)
        k_index = inputs.index_keys(b, torch.bfloat16, gen)
        cases.append(Case("store_index_k", {"b": b, "page": page}, family="kv_cache",
                          kernel=partial(kv_kernels.launch_store_index_k, cache, slots, k_index, page),
                          reference=partial(ref_kv.store_index_k, cache, slots, k_index, page),
                          bytes=b * (2 * INDEX_HEAD_DIM + 8 + layout.INDEX_ENTRY_BYTES)))
    return cases


# -- metadata cases ----------------------------------------------------------------------------
def _decode_step(req_to_token, b, capacity, gen):
    """A decode step of b distinct requests, lengths uniform in [capacity / 2, capacity]."""
    rows = torch.randperm(req_to_token.shape[0] - 1, generator=gen, device=gen.device)[:b] + 1
    seq = torch.randint(capacity // 2, capacity + 1, (b,), generator=gen, device=gen.device)
    return inputs.make_step(req_to_token, rows, seq, [1] * b, mode=ForwardMode.DECODE)


def metadata_cases(args) -> list[Case]:
    """Each metadata op, and all of them chained, for decode at b requests and each capacity.

    Each op runs on the reference's upstream fields (taken by name). The chain runs through the
    ``dsv4::`` ops as ``build_step_metadata`` runs it (``metadata_chain.run_chain``: the five
    kernels, without the ``positions`` subtraction) and fused (``dsv4::step_metadata``'s launcher);
    both are timed against the reference of the whole chain.

    Bytes count useful data only, int32 throughout: expand reads 3 x 4 B per request and writes
    16 B per row; page_table reads the live prefix of the row's compact page map (contiguous) and
    writes 4 B per page; swa reads 128 slots and 128 mapped slots and writes
    130 entries; c4 reads 16 B and writes 12 B per row; c128 writes its full width and reads the
    page-table entries of the visible prefix (about L / 256 per row). The fused kernel reads
    neither the page table nor the request row of each row back.
    """
    cases = []
    for capacity in args.capacity:
        gen = torch.Generator(device=args.device).manual_seed(capacity)
        req_to_token, full_to_swa = inputs.index_maps(max(args.batch), capacity, gen)
        maps = (req_to_token, ref_meta.page_map(req_to_token), full_to_swa)
        n_pages = capacity // PAGE_SIZE
        width = FIELDS_BY_NAME["c128_indices"].columns(n_pages)
        for b in args.batch:
            step = _decode_step(req_to_token, b, capacity, gen)
            want = named(ref_meta.step_metadata(*step.tensors(), *maps, INDEX_TOPK))
            req_of_row, seq_causal, loc = want["req_of_row"], want["seq_lens_causal"], step.out_cache_loc
            rows = req_to_token.shape[0]
            visible_pages = int(step.seq_lens.sum()) // PAGE_SIZE
            params = {"b": b, "capacity": capacity}
            per_op = {  # op -> (arguments, bytes)
                "expand_queries": (step.tensors(), 28 * b),
                "build_page_table": ((maps[1], req_of_row, seq_causal), 4 * b * n_pages + 4 * visible_pages + 8 * b),
                "build_swa_metadata": ((req_to_token, full_to_swa, req_of_row, seq_causal, loc),
                                       b * (4 * (3 * SWA_WINDOW + 4) + 8)),
                "build_c4_metadata": ((req_of_row, seq_causal, loc, INDEX_TOPK, rows), 28 * b),
                "build_c128_metadata": ((want["page_table"], req_of_row, seq_causal, loc, rows),
                                        4 * b * width + 4 * visible_pages + 28 * b),
            }
            for op, (op_args, nbytes) in per_op.items():
                cases.append(Case(op, params, family="metadata", bytes=nbytes,
                                  kernel=partial(getattr(meta_kernels, f"launch_{op}"), *op_args),
                                  reference=partial(getattr(ref_meta, op), *op_args)))
            chain_bytes = sum(nbytes for _, nbytes in per_op.values())
            reference = partial(ref_meta.step_metadata, *step.tensors(), *maps, INDEX_TOPK)
            cases.append(Case("decode_metadata_total", params, family="metadata", bytes=chain_bytes,
                              kernel=partial(run_chain, torch.ops.dsv4, *step.tensors(), *maps, INDEX_TOPK),
                              reference=reference, notes="expand + page_table + swa + c4 + c128 (5 launches)"))
            cases.append(Case("decode_metadata_fused", params, family="metadata",
                              bytes=chain_bytes - 4 * visible_pages - 8 * b,
                              kernel=partial(meta_kernels.launch_step_metadata, *step.tensors(), *maps, INDEX_TOPK),
                              reference=reference, notes="dsv4::step_metadata: the same outputs in one launch"))
    return cases


# -- compressor and indexer cases --------------------------------------------------------------
def _compress_case(name, args, params) -> Case:
    """Bytes: ``compress_kv_bytes`` (kv + score read, ring and entry written, ring slots read)."""
    return Case(name, params, family="compressor", bytes=compress_kv_bytes(args),
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
            cargs = compress_index.compressor_args(ratio, d, seq, [1] * b, gen)
            cases.append(_compress_case("compress_kv", cargs, {"b": b, "compressor": label}))
        gen = torch.Generator(device=args.device).manual_seed(ratio + d)
        cargs = compress_index.compressor_args(ratio, d, [prefill_rows], [prefill_rows], gen)
        cases.append(_compress_case("compress_kv_prefill", cargs, {"T": prefill_rows, "compressor": label}))
    return cases


def prepare_q_cases(args) -> list[Case]:
    """Bytes: q read (bf16) and weights; fp8 q and fp32 w written."""
    cases = []
    inv_freq = layer_inv_freq(compress_index.CONFIG, 4).to(args.device)
    scale = compress_index.CONFIG.index_weight_scale
    for b in args.batch:
        gen = torch.Generator(device=args.device).manual_seed(b)
        q, w = compress_index.indexer_q(b, INDEX_HEADS, gen)
        pos = torch.randint(0, 1 << 20, (b,), generator=gen, device=args.device, dtype=torch.int32)
        op_args = (q, w, pos, inv_freq, scale)
        cases.append(Case("indexer_prepare_q", {"b": b}, family="indexer",
                          bytes=b * INDEX_HEADS * (2 * INDEX_HEAD_DIM + 2 + INDEX_HEAD_DIM + 4),
                          kernel=partial(index_kernels.launch_indexer_prepare_q, *op_args),
                          reference=partial(ref_index.indexer_prepare_q, *op_args)))
    return cases


def _scan(q_fp8, w, cache, page_table, visible, topk, ws, minmax):
    index_kernels.launch_indexer_logits(q_fp8, w, cache, page_table, visible, topk, ws, minmax)


def topk_cases(args) -> list[Case]:
    """indexer_logits / indexer_topk for every (b, capacity) on one shared cache.

    Bytes: the scan reads 132 B per visible entry (128 fp8 + fp32 scale) and writes a 4 B logit;
    topk adds the select's reads of the logits (three 4 B passes) and the output.
    """
    cases = []
    page_tokens = 4 * layout.INDEX_PAGE_SIZE  # tokens per c4 index page
    max_pages = max(args.batch) * max(args.capacity) // page_tokens
    gen = torch.Generator(device=args.device).manual_seed(0)
    cache = compress_index.random_index_cache(max_pages + 1, gen)
    inv_freq = layer_inv_freq(compress_index.CONFIG, 4).to(args.device)
    weight_scale = compress_index.CONFIG.index_weight_scale
    for capacity in args.capacity:
        num_pages = capacity // page_tokens
        entries = num_pages * layout.INDEX_PAGE_SIZE
        for b in args.batch:
            q, w = compress_index.indexer_q(b, INDEX_HEADS, gen)
            visible = torch.full((b,), entries, dtype=torch.int32, device=args.device)
            q_fp8, w = ref_index.indexer_prepare_q(q, w, 4 * visible, inv_freq, weight_scale)
            pt = compress_index.page_table(b, num_pages, max_pages + 1, gen)
            op_args = (q_fp8, w, cache, pt, visible, INDEX_TOPK)
            scanned = b * entries
            ref_logits = partial(ref_index.indexer_logits, *op_args[:4])
            with_ref = scanned <= _REFERENCE_MAX_ENTRIES
            params = {"b": b, "capacity": capacity, "topk": INDEX_TOPK}
            ws, minmax = index_kernels.indexer_workspace(b, entries, args.device)
            if ws.shape[0] == b:  # the scan alone, when one workspace chunk holds every row
                cases.append(Case("indexer_logits", params, family="indexer",
                                  bytes=scanned * (layout.INDEX_ENTRY_BYTES + 4),
                                  kernel=partial(_scan, *op_args, ws, minmax),
                                  reference=ref_logits if with_ref else None,
                                  notes="target >= 60% of HBM at >= 128k"))
            cases.append(Case("indexer_topk", params, family="indexer",
                              bytes=scanned * (layout.INDEX_ENTRY_BYTES + 16) + 4 * b * INDEX_TOPK,
                              kernel=partial(index_kernels.launch_indexer_topk, *op_args),
                              reference=partial(ref_index.indexer_topk, *op_args) if with_ref else None))
    return cases


# -- routed-expert cases ----------------------------------------------------------------------
# (experts E, experts per token K, layers cycled): the bench_model MoE (8 of 4096 x 2048, 2 a token;
# 4 layers' weights, so that the L2 holds none of them across calls) and the Flash model's (256, 6)
EXPERT_SHAPES = ((8, 2, 4), (256, 6, 1))
EXPERT_DIMS = {"cuda": (4096, 2048), "cpu": (64, 32)}  # (hidden H, intermediate I); tiny for --dry-run on CPU


def experts_cases(args) -> list[Case]:
    """``dsv4::routed_experts`` (the Triton kernels up to ``MAX_SLOTS`` slots, grouped GEMMs above)
    against the grouped GEMMs alone (``grouped_routed_experts``, the sorted-slot path transformers'
    ``grouped_mm`` also takes), for b tokens each routed to K distinct experts, over each of the
    cycled layers' weights in one call.

    Bytes: the weights of every expert some token reaches (3 H I bf16 each), per layer, plus x read
    and the slots' outputs written."""
    hidden, inter = EXPERT_DIMS[torch.device(args.device).type]
    cases = []
    for num_experts, topk, layers in EXPERT_SHAPES:
        gen = torch.Generator(device=args.device).manual_seed(num_experts)
        weights = [((torch.randn(num_experts, 2 * inter, hidden, generator=gen, device=args.device) * 0.02)
                    .bfloat16(), (torch.randn(num_experts, hidden, inter, generator=gen, device=args.device) * 0.02)
                    .bfloat16()) for _ in range(layers)]
        for b in args.batch:
            x = torch.randn(b, hidden, generator=gen, device=args.device).bfloat16()
            ids = torch.rand(b, num_experts, generator=gen, device=args.device).argsort(dim=1)[:, :topk]
            reached = ids.unique().numel()

            def over_layers(fn, x=x, ids=ids, weights=weights):  # bound now: the loops rebind them
                return [fn(x, ids, gate_up, down, 10.0) for gate_up, down in weights]

            params = {"b": b, "experts": num_experts, "topk": topk, "layers": layers}
            nbytes = layers * (reached * 3 * hidden * inter + b * hidden + b * topk * hidden) * 2
            extra = {"slots": b * topk, "kernels": b * topk <= expert_kernels.MAX_SLOTS}
            cases.append(Case("routed_experts", params, family="experts",
                              kernel=partial(over_layers, torch.ops.dsv4.routed_experts),
                              reference=partial(over_layers, experts_ops.grouped_routed_experts), bytes=nbytes,
                              notes=f"{reached} experts reached; reference: the grouped GEMMs", extra=extra))
            for tile in map(_tile, args.expert_tiles if extra["kernels"] else ()):
                launch = partial(expert_kernels.launch_routed_experts, gate_up_config=tile, down_config=tile)
                cases.append(Case("routed_experts", {**params, "tile": tile}, family="experts",
                                  kernel=partial(over_layers, launch), reference=None, bytes=nbytes,
                                  notes=f"{reached} experts reached; both kernels at the tile", extra=extra))
    return cases


# (experts, per token): the benchmark model's router and the released models'
ROUTER_SHAPES = ((8, 2), (256, 6))


def router_topk_cases(args) -> list[Case]:
    """``dsv4::topk_indices`` (one Triton program per token) against the learned router's
    ``torch.topk(scores, k, sorted=False).indices``, for b tokens' fp32 scores over E experts.
    Bytes: the scores read and the indices written."""
    cases = []
    for num_experts, topk in ROUTER_SHAPES:
        for b in args.batch:
            scores = torch.rand(b, num_experts, device=args.device)
            cases.append(Case("router_topk", {"b": b, "experts": num_experts, "topk": topk}, family="experts",
                              kernel=partial(torch.ops.dsv4.topk_indices, scores, topk),
                              reference=partial(lambda s, k: torch.topk(s, k, dim=-1, sorted=False).indices,
                                                scores, topk),
                              bytes=b * (4 * num_experts + 8 * topk), notes="reference: aten topk"))
    return cases


# -- linear cases ------------------------------------------------------------------------------
# (name, groups, output features per group, K): the Flash model's products that are not part of a
# shared-input group; tiny on the CPU for --dry-run
LINEAR_SHAPES = {"cuda": (("o_b", 1, 4096, 8192), ("q_b", 1, 32768, 1024), ("shared_down", 1, 4096, 2048),
                          ("lm_head", 1, 129280, 4096), ("o_a", 8, 1024, 4096)),
                 "cpu": (("o_b", 1, 48, 64), ("o_a", 2, 24, 32))}
_L2_SAFE_BYTES = 1 << 30  # a weight this large is not held in the L2 between calls on its own
_NORM_EPS = 1e-6


def _tile(text: str) -> tuple[int, int, int, int]:
    block_n, block_k, warps, stages = map(int, text.split("x"))
    return block_n, block_k, warps, stages


def linear_cases(args) -> list[Case]:
    """``dsv4::linears``' kernel (one weight) / ``dsv4::grouped_linear``'s at b rows (up to 64: the
    ops run cuBLAS above) against cuBLAS, each call cycling over copies of the weight; a product of
    K < ``DEEP_K`` (the query latent's ``q_b``) also with its input's RMSNorm folded into the
    launch (``<product> normed``) against the norm, then cuBLAS. Bytes: the weight read, x read,
    the output written."""
    cases = []
    for name, groups, n, k in LINEAR_SHAPES[torch.device(args.device).type]:
        gen = torch.Generator(device=args.device).manual_seed(n)
        copies = 1 if groups * n * k * 2 >= _L2_SAFE_BYTES else 4
        weights = [(torch.randn(groups * n, k, generator=gen, device=args.device) * 0.02).bfloat16()
                   for _ in range(copies)]
        norms = {name: None}
        if groups == 1 and k < linear_kernels.DEEP_K:
            norms[f"{name} normed"] = (torch.rand(k, generator=gen, device=args.device) + 0.5).bfloat16()
        for b in (b for b in args.batch if b <= linear_kernels.MAX_ROWS):  # the ops' cuBLAS above
            x = torch.randn(b, groups, k, generator=gen, device=args.device).bfloat16()
            nbytes = (groups * n * k + b * groups * (k + n)) * 2
            for product, norm in norms.items():
                if groups == 1:
                    def kernel(config=None, x=x[:, 0], weights=weights, norm=norm):
                        return [linear_kernels.launch_linears(x, [w], config, norm_weight=norm, eps=_NORM_EPS)
                                for w in weights]

                    def cublas(x=x[:, 0], weights=weights, norm=norm):
                        return [(x if norm is None else F.rms_norm(x, x.shape[-1:], norm, _NORM_EPS)) @ w.T
                                for w in weights]
                else:
                    def kernel(config=None, x=x, weights=weights):
                        return [linear_kernels.launch_grouped_linear(x, w, config) for w in weights]

                    def cublas(x=x, weights=weights):
                        return [grouped_linear_reference(x, w) for w in weights]
                for tile in (None, *map(_tile, args.linear_tiles)):
                    params = {"b": b, "product": product, "copies": copies,
                              "tile": "default" if tile is None else tile}
                    cases.append(Case("linear", params, family="linears", kernel=partial(kernel, tile),
                                      reference=cublas if tile is None else None, bytes=copies * nbytes,
                                      notes="reference: cuBLAS" if norm is None else "reference: the norm, cuBLAS"))
    return cases


CASE_BUILDERS: list[Callable[[argparse.Namespace], list[Case]]] = [
    kv_cache_cases, metadata_cases, compressor_cases, prepare_q_cases, topk_cases, experts_cases, router_topk_cases,
    linear_cases]


# -- driver ------------------------------------------------------------------------------------
def run(args) -> dict:
    """Time every selected case (or, with ``--dry-run``, call each once) and summarise."""
    flush = None
    if args.cold_l2:
        l2 = torch.cuda.get_device_properties(0).L2_cache_size
        scratch = torch.empty(2 * l2, dtype=torch.uint8, device=args.device)
        flush = scratch.zero_
    results = []
    for builder in CASE_BUILDERS:
        for case in builder(args):
            label = f"{case.name} {case.params}"
            if args.only and not any(s in f"{case.family} {label}" for s in args.only):
                continue
            if args.dry_run:
                case.kernel()
                if case.reference is not None:
                    case.reference()
                print(f"{label:60s} ran", flush=True)
                continue
            row = {"name": case.name, "family": case.family, "params": case.params, "bytes": case.bytes,
                   "notes": case.notes, **case.extra}
            try:
                row["kernel_us"] = time_case(case.kernel, args, flush)
            except OutOfResources as err:  # a tile asked for on the command line that this GPU cannot hold
                if case.params.get("tile", "default") == "default":
                    raise
                results.append({**row, "error": str(err)})
                print(f"{label:60s} does not fit: {err}", flush=True)
                continue
            row["kernel_GBps"] = case.bytes / row["kernel_us"] / 1e3
            row["kernel_peak_frac"] = row["kernel_GBps"] / PEAK_GBPS
            if case.reference is not None and not args.no_reference:
                row["reference_us"] = time_case(case.reference, args, flush)
                row["speedup"] = row["reference_us"] / row["kernel_us"]
            results.append(row)
            ref_txt = f"ref {row['reference_us']:9.2f} µs  x{row['speedup']:6.1f}" if "reference_us" in row else ""
            print(f"{label:60s} {row['kernel_us']:8.2f} µs {row['kernel_GBps']:8.1f} GB/s "
                  f"({100 * row['kernel_peak_frac']:5.1f}%)  {ref_txt}", flush=True)
            torch.cuda.empty_cache()
    if args.dry_run:
        return {}
    summary = {}
    for key, (name, params, target) in STEP_BUDGETS.items():
        hits = [r for r in results if r["name"] == name and all(r["params"].get(k) == v for k, v in params.items())]
        if hits:
            summary[key] = {"us": hits[0]["kernel_us"], "target_us": target, "met": hits[0]["kernel_us"] <= target}
            print(f"{key}: {hits[0]['kernel_us']:.2f} µs (target {target} µs)")
    return {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "args": vars(args),
            "results": results, "summary": summary}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 32, 256], help="requests (rows) per step")
    parser.add_argument("--capacity", type=int, nargs="+", default=[8192, 131072, 1 << 20],
                        help="tokens per request (L_max) for the metadata and indexer cases")
    parser.add_argument("--iters", type=int, default=100, help="graph replays timed")
    parser.add_argument("--inner", type=int, default=20, help="calls captured per graph")
    parser.add_argument("--only", nargs="*", default=[], help="keep cases whose 'family name {params}' "
                        "contains any of these substrings")
    parser.add_argument("--cold-l2", action="store_true", help="flush the L2 before every call")
    parser.add_argument("--no-reference", action="store_true", help="time the kernels only")
    parser.add_argument("--json", default="bench_ops.json", help="output file")
    parser.add_argument("--dry-run", action="store_true", help="call each case once, no timing "
                        "(a smoke test; with --device cpu it runs under TRITON_INTERPRET=1)")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--select", choices=sorted(topk_select.PATH_LIMITS), help="force this path of the top-k select")
    parser.add_argument("--linear-tiles", nargs="*", default=[], metavar="NxKxWxS",
                        help="also time the linear kernels at these tiles (BLOCK_N x BLOCK_K x warps x stages)")
    parser.add_argument("--expert-tiles", nargs="*", default=[], metavar="NxKxWxS",
                        help="also time both routed-expert kernels at these tiles")
    args = parser.parse_args(argv)
    if args.select:
        for name, limit in topk_select.PATH_LIMITS[args.select].items():
            setattr(topk_select, name, limit)
    if args.device == "cuda" and not torch.cuda.is_available():
        sys.exit("bench_ops.py needs a CUDA device")
    if not args.dry_run and args.device != "cuda":
        sys.exit("timing needs --device cuda")
    report = run(args)
    if args.dry_run:
        return
    Path(args.json).write_text(json.dumps(report, indent=1))
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
