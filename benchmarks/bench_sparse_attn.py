"""Benchmark ``dsv4::sparse_attn``: our Triton / Gluon kernels vs FlashMLA vs the torch reference.

Usage:
    python benchmarks/bench_sparse_attn.py [--out results.json] [--cases c4_flash_b1,c4_pro_b128]
        [--reps 10] [--iters 50] [--reference-max-row-keys 131072] [--sweep] [--no-flashmla]
        [--kernel-info]

Implementations: ``triton`` (the op, which picks the fused, warp-specialised or two-pass path from
the shapes and the GPU), ``triton_fused``, ``triton_ws`` and ``triton_two_pass`` (each path forced;
``triton_ws`` reports an error off sm_90), ``flashmla``, ``flashmla_op``, ``reference``. Every
implementation is timed the same way (``dsv4_compile.testing.bench.graph_us``): ``--reps``
back-to-back calls captured in one ``torch.cuda.CUDAGraph``, the graph replayed ``--iters`` times,
each replay timed with CUDA events; the median per call is reported (warm L2: the same inputs
every call). FlashMLA is timed as the raw ``flash_mla_with_kvcache`` call on pre-sanitised int32
indices with a reused scheduler metadata (its best case, the anchor of the ratio column), and as
our ``dsv4::sparse_attn_flashmla`` op (index sanitising included). The reference runs only where
``rows x entries <= --reference-max-row-keys``. ``--sweep`` also times the fused path over block
sizes, pipeline stages and split counts, the two-pass path over block sizes, warps and stages,
and on sm_90 the warp-specialised ring shapes and L2 prefetch; ``--kernel-info`` prints
registers, spills and shared memory of every compiled kernel variant at the end.

Columns: µs per call; TFLOPS-equivalent, ``sparse_attn_flops``; GB/s, ``sparse_attn_bytes`` (both
in ``dsv4_compile.testing.bench``); ratio = FlashMLA µs / µs (> 1: faster than FlashMLA). The
``c4_flash_h*`` cases hold 8 / 16 / 32 heads, as one rank does under tensor parallelism. Inputs
are full-length rows (no holes), every row with its own entries scattered over the pools, except
prefill rows, which share one request's pools.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass

import torch

import dsv4_compile  # noqa: F401  (registers the dsv4:: ops)
from dsv4_compile.config import HEAD_DIM
from dsv4_compile.attention import sparse_attn
from dsv4_compile.ops.kernels import flashmla, sparse_attn_combine, sparse_attn_fused, sparse_attn_warp_specialized
from dsv4_compile.ops.kernels import sparse_attn_dispatch as dispatch
from dsv4_compile.ops.kernels import sparse_attn_two_pass as two_pass
from dsv4_compile.ops.kernels.host import num_sms as device_sms
from dsv4_compile.reference import sparse_attn as ref
from dsv4_compile.testing.attn_inputs import AttnInputs, make_attn_inputs
from dsv4_compile.testing.bench import graph_us, sparse_attn_bytes, sparse_attn_flops


@dataclass(frozen=True)
class AttnShape:
    """One benchmarked input shape (a case of ``--cases``): query rows x heads, the extra cache
    kind and index width, and pool capacities (None: distinct entries per row)."""

    name: str
    rows: int
    heads: int
    extra: str | None
    extra_width: int
    swa_capacity: int | None = None
    extra_capacity: int | None = None


CASES = [AttnShape(f"c4_flash_b{b}", b, 64, "c4", 512) for b in (1, 8, 32, 128, 256)] + [
    AttnShape("c128_flash_128k_b64", 64, 64, "c128", 1024),
    AttnShape("c128_flash_1m_b64", 64, 64, "c128", 8192),
    AttnShape("c4_pro_b64", 64, 128, "c4", 1024),
    AttnShape("c4_pro_b128", 128, 128, "c4", 1024),
    AttnShape("c4_flash_prefill_t2048", 2048, 64, "c4", 512, swa_capacity=2048 + 128, extra_capacity=16384),
] + [  # the heads one rank holds under tensor parallelism (FlashMLA pads them to 64)
    AttnShape(f"c4_flash_h{h}_b{b}", b, h, "c4", 512) for h in (8, 16, 32) for b in (1, 8, 32, 128)
]


def flashmla_raw(inp: AttnInputs):
    """The raw FlashMLA call on pre-sanitised inputs with a scheduler metadata reused across calls;
    q and the sink padded to the 64 or 128 heads FlashMLA runs (zero q rows, -inf sinks)."""
    fm = flashmla.flash_mla_module()
    sched = fm.get_mla_metadata()[0]
    cap = inp.swa.capacity
    idx = torch.where(inp.swa.indices < cap, inp.swa.indices, -1).int().unsqueeze(1)
    pad = flashmla.padded_heads(inp.q.shape[1]) - inp.q.shape[1]
    q = torch.nn.functional.pad(inp.q, (0, 0, 0, pad))
    sink = torch.nn.functional.pad(inp.attn_sink, (0, pad), value=float("-inf"))
    kw = dict(softmax_scale=inp.softmax_scale, is_fp8_kvcache=True, indices=idx, attn_sink=sink,
              topk_length=inp.swa.lengths.int(), use_legacy=True, kv_format="V4")
    if inp.extra is not None:
        kw.update(extra_k_cache=flashmla.cache_view(inp.extra.cache, inp.extra.page_size),
                  extra_indices_in_kvcache=inp.extra.indices.int().unsqueeze(1),
                  extra_topk_length=inp.extra.lengths.int())
    q, cache = q.unsqueeze(1), flashmla.cache_view(inp.swa.cache, inp.swa.page_size)
    return lambda: fm.flash_mla_with_kvcache(q, cache, None, None, HEAD_DIM, sched, None, **kw)


SWEEP = ((32, 3), (64, 3), (32, 2))  # fused path: (keys per block, pipeline stages)
TWO_PASS_SWEEP = ((128, (4, 4), (3, 3)), (128, (4, 4), (2, 2)), (64, (4, 4), (3, 3)), (128, (8, 4), (3, 3)))
# two-pass path: (keys per block, warps of the scores / values kernels, their pipeline stages)
WS_SWEEP = ((64, 2, True), (64, 2, False), (32, 3, None), (32, 4, None))
# warp-specialised path on sm_90: (keys per ring slot, ring slots, L2 prefetch; None: by list length)


def sweep_configs(inp: AttnInputs):
    """(label, launcher kwargs) for --sweep: fused path block sizes x stages and split counts
    around the shape-based choice; two-pass path block sizes, warps and stages; warp-specialised
    ring shapes and L2 prefetch (sm_90 only)."""
    rows, heads, _ = inp.q.shape
    num_sms = device_sms(inp.q.device)
    head_block, _ = dispatch.choose_tiling(rows, heads, inp.entries_per_row(), num_sms)
    head_blocks = -(-heads // head_block)
    for block_n, stages in SWEEP:
        auto = dispatch.choose_splits(rows, head_blocks, inp.entries_per_row(), block_n, num_sms)
        for splits in sorted({auto, max(1, auto // 2), 2 * auto} if auto > 1 else {1}):
            kw = dict(fused=sparse_attn_fused.FusedConfig(block_n, stages), num_splits=splits, path="fused")
            yield f"bn{block_n}_st{stages}_s{splits}", kw
    for block_n, warps, stages in TWO_PASS_SWEEP:
        config = two_pass.TwoPassConfig(block_n=block_n, num_warps=warps, num_stages=stages)
        yield (f"2p_bn{block_n}_w{warps[0]}{warps[1]}_st{stages[0]}{stages[1]}",
               dict(path="two_pass", two_pass=config))
    if sparse_attn_warp_specialized.available(inp.q.device):
        for block_n, stages, prefetch in WS_SWEEP:
            label = "" if prefetch is None else ("_pf" if prefetch else "_nopf")
            config = sparse_attn_warp_specialized.WarpSpecializedConfig(block_n=block_n, stages=stages,
                                                                       prefetch=prefetch)
            yield f"ws_bn{block_n}_st{stages}{label}", dict(path="warp_specialized", warp_specialized=config)


def max_diff(got, want) -> dict:
    """Largest |difference| of out and lse against the default Triton path (sanity, not accuracy)."""
    return dict(out_diff=(got[0].float() - want[0].float()).abs().max().item(),
                lse_diff=(got[1] - want[1]).abs().max().item())


def run_case(case: AttnShape, args) -> list[dict]:
    inp = make_attn_inputs(case.rows, case.heads, extra=case.extra, extra_width=case.extra_width,
                           swa_capacity=case.swa_capacity, extra_capacity=case.extra_capacity,
                           seed=0, device="cuda")
    base = dict(case=case.name, rows=case.rows, heads=case.heads, entries=inp.entries_per_row())
    impls = {"triton": lambda: sparse_attn(*inp.args()),  # the op's choice of path
             "triton_fused": lambda: dispatch.launch_sparse_attn(*inp.args(), path="fused"),
             "triton_ws": lambda: dispatch.launch_sparse_attn(*inp.args(), path="warp_specialized"),
             "triton_two_pass": lambda: dispatch.launch_sparse_attn(*inp.args(), path="two_pass")}
    if args.flashmla and flashmla.available():
        impls["flashmla"] = flashmla_raw(inp)
        impls["flashmla_op"] = lambda: torch.ops.dsv4.sparse_attn_flashmla(*inp.op_args())
    if case.rows * inp.entries_per_row() <= args.reference_max_row_keys:
        impls["reference"] = lambda: ref.sparse_attn(*inp.args())
    if args.sweep:
        for label, kw in sweep_configs(inp):
            impls[f"triton_{label}"] = lambda kw=kw: dispatch.launch_sparse_attn(*inp.args(), **kw)
    want = impls["triton"]()
    records = []
    for impl, fn in impls.items():
        try:
            us = graph_us(fn, args.iters, args.reps)
            diff = max_diff(fn(), want) if impl.startswith(("triton_", "flashmla_op")) else {}
        except Exception as e:  # noqa: BLE001  (report and go on: one failure must not hide the rest)
            records.append(dict(base, impl=impl, error=repr(e)[:300]))
            continue
        records.append(dict(base, impl=impl, us=us, tflops=sparse_attn_flops(inp) / us * 1e-6,
                            gbps=sparse_attn_bytes(inp) / us * 1e-3, **diff))
    anchor = next((r["us"] for r in records if r["impl"] == "flashmla" and "us" in r), None)
    for r in records:
        if anchor and "us" in r:
            r["vs_flashmla"] = anchor / r["us"]
    return records


def print_kernel_info() -> None:
    kernels = [sparse_attn_fused._sparse_attn_fused, sparse_attn_combine._combine_kernel, two_pass._block_scores,
               two_pass._block_values]
    if sparse_attn_warp_specialized.gluon is not None:
        kernels.append(sparse_attn_warp_specialized._sparse_attn_warp_specialized)
    for fn in kernels:
        for caches in fn.device_caches.values():
            for compiled in caches[0].values():
                meta = compiled.metadata
                consts = getattr(getattr(compiled, "src", None), "constants", {})
                print(f"{fn.__name__}: warps {meta.num_warps} stages {meta.num_stages} "
                      f"regs {compiled.n_regs} spills {compiled.n_spills} smem {meta.shared} {consts}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", help="write all records as JSON here")
    parser.add_argument("--cases", help="comma-separated case names (default: all)")
    parser.add_argument("--reps", type=int, default=10, help="calls captured per graph")
    parser.add_argument("--iters", type=int, default=50, help="graph replays timed")
    parser.add_argument("--reference-max-row-keys", type=int, default=1 << 17)
    parser.add_argument("--sweep", action="store_true", help="also time Triton tuning configs")
    parser.add_argument("--no-flashmla", dest="flashmla", action="store_false")
    parser.add_argument("--kernel-info", action="store_true", help="registers / spills of Triton variants")
    args = parser.parse_args()
    wanted = set(args.cases.split(",")) if args.cases else None
    print(f"{torch.cuda.get_device_name()}  torch {torch.__version__}  flash_mla: {flashmla.available()}")
    print(f"{'case':26} {'impl':22} {'entries':>7} {'µs':>9} {'TFLOPS':>7} {'GB/s':>7} {'vs FlashMLA':>11}")
    records = []
    for case in CASES:
        if wanted and case.name not in wanted:
            continue
        case_records = run_case(case, args)
        torch.cuda.empty_cache()  # the case's inputs went with run_case's frame
        for r in case_records:
            records.append(r)
            if "error" in r:
                print(f"{r['case']:26} {r['impl']:22} ERROR {r['error']}")
                continue
            ratio = f"{r['vs_flashmla']:.2f}x" if "vs_flashmla" in r else "-"
            diff = f"  diff out {r['out_diff']:.2e} lse {r['lse_diff']:.2e}" if "out_diff" in r else ""
            print(f"{r['case']:26} {r['impl']:22} {r['entries']:7d} {r['us']:9.1f} {r['tflops']:7.1f} "
                  f"{r['gbps']:7.0f} {ratio:>11}{diff}", flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(records, f, indent=1)
    if args.kernel_info:
        print_kernel_info()


if __name__ == "__main__":
    main()
