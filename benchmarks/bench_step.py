"""Per-step latency of one multi-layer DSV4 decode step, several ways, side by side in one run.

Usage:
    python benchmarks/bench_step.py --out step.json            # on a CUDA machine
    python benchmarks/bench_step.py --ways compile-step --profile --out step.json   # where the time goes
    python benchmarks/bench_step.py --ways compile-step,compile-step-graphs --host --out step.json  # host µs a call
    python benchmarks/bench_step.py --plot step.json --png step.png   # plot a saved run (any machine)

Ways (the same stack, cache and step tensors):
    eager            stack(x, step) with Python launches per op
    compile          torch.compile(stack, fullgraph=True) (no CUDA graphs)
    reduce-overhead  torch.compile(stack, mode="reduce-overhead", fullgraph=True): CUDA-graph
                     trees, metadata recomputed inside the graph, no bookkeeping
    compile-step     dsv4_compile.compile_step(stack, mode="reduce-overhead"), as users compile it:
                     the default FX passes, dynamic shapes, device checks
    compile-step-graphs  the same with cuda_graphs="step": the whole compiled step captured as one
                     CUDA graph per input signature, replayed without entering Dynamo
    compile-step-graphs-pdl  the same with Inductor's kernels under programmatic dependent launch
                     (``triton.enable_pdl``)
    compile-step-graphs-mm-above-16  compile-step-graphs with products of more than 16 rows through
                     cuBLAS (``torch.mm``) instead of ``dsv4::linears``' kernel
    compile-step-graphs-entry-store-apart  compile-step-graphs without ``FuseEntryStorePass``: each
                     compressor's entries written by a launch of their own, not by its entry kernel
    compile-step-graphs-rotation-apart  compile-step-graphs without ``FuseAttentionInverseRopePass``:
                     each attention output rotated back by a launch before its product, not in the
                     attention's split combine
    compile-step-graphs-side-stream  compile-step-graphs with ``OverlapCacheWritesPass`` added to
                     the default passes: each layer's cache writes on a second stream, beside the
                     query's products
    compile-step-graphs-q-norm-folded  compile-step-graphs with each query latent's norm folded into
                     its ``q_b`` products' launch, not a launch of its own (``FuseSharedInputLinearsPass(
                     fold_input_norm=True)``)
    manual-graph     the seed's approach, minimal: static input buffers, the eager step captured
                     once with torch.cuda.CUDAGraph, inputs copied in before each replay

Requests are admitted to a :class:`dsv4_compile.engine.Engine` and each holds ``context`` tokens
(pages allocated through the engine's PageAllocator, cache pages filled with valid FP8 entries); the
timed step, built by the engine and then rolled back so the context stays fixed, decodes one token
per request. Time per step is the median over CUDA-event-timed iterations (inputs copied in for
manual-graph; the compiled function copies its own). The weight floor is the stack's parameter bytes
at ``--hbm-tbps`` (the GPU's peak unless given); "TB/s" those bytes over the step time.
``--profile`` adds, per graph way, ``torch.profiler`` figures over ``--iters`` back-to-back steps:
wall µs per step, GPU busy µs (summed kernel times), host overhead (their difference: the time the
GPU waits for the host) and kernels per step. ``--host`` adds, per graph way, the host's own µs per
call with the GPU kept busy (``testing.bench.host_us_per_call``: calls queued behind a GPU sleep, so
none waits for the device); for the whole-step-graph ways also the µs per call of calls issued back
to back, against the same loop of bare ``replay()`` calls of the graph they replay: their difference
is what the host adds to a stream of steps (the profiler's wall − busy also counts its own
per-kernel overhead); and a call with the graph's own static inputs (``StepGraphs.static_inputs``:
nothing copied), waited for and its host µs, beside a bare ``replay()``'s host µs queued the same
way (the driver's share: where a graph's launches fill the device's queue, both block). A profile
detaches CUPTI when it ends (``profile_steps``), so the batches and ways timed after it are not
slowed by it (left attached, a 43-layer graph's waited call took 154 µs of host time after a
profile, 7 before).
"""

from __future__ import annotations

import argparse
import json
import statistics
from contextlib import nullcontext

import torch

from dsv4_compile import DSV4AttnConfig, DSV4AttentionStack, DSV4Cache, ForwardMode, StepInputs
from dsv4_compile.compile import compile_step
from dsv4_compile.config import PAGE_SIZE
from dsv4_compile.engine import Engine
from dsv4_compile.fx_passes import (DSV4PassManager, FuseAttentionInverseRopePass, FuseEntryStorePass,
                                    FuseSharedInputLinearsPass, OverlapCacheWritesPass)
from dsv4_compile.fx_passes.pass_manager import default_passes
from dsv4_compile.testing.bench import (hbm_tbps_argument, header, host_us_per_call, linears_max_rows,
                                        passes_configured, passes_without, profile_steps)

GRAPH_WAYS = ("reduce-overhead", "compile-step", "compile-step-graphs", "compile-step-graphs-pdl",
              "compile-step-graphs-mm-above-16", "compile-step-graphs-entry-store-apart",
              "compile-step-graphs-rotation-apart", "compile-step-graphs-side-stream",
              "compile-step-graphs-q-norm-folded", "manual-graph")  # --profile / --host
# --host: also back to back, and the graph alone
STEP_GRAPH_WAYS = ("compile-step-graphs", "compile-step-graphs-pdl", "compile-step-graphs-mm-above-16",
                   "compile-step-graphs-entry-store-apart", "compile-step-graphs-rotation-apart",
                   "compile-step-graphs-side-stream", "compile-step-graphs-q-norm-folded")
# ways with whole-step graphs compiled with other passes than the defaults
PASSES = {"compile-step-graphs-entry-store-apart": lambda: passes_without(FuseEntryStorePass),
          "compile-step-graphs-rotation-apart": lambda: passes_without(FuseAttentionInverseRopePass),
          "compile-step-graphs-side-stream": lambda: [*default_passes(), OverlapCacheWritesPass()],
          "compile-step-graphs-q-norm-folded":
              lambda: passes_configured(FuseSharedInputLinearsPass, fold_input_norm=True)}
# ways measured (and so captured) under a kernel setting: the products of more than 16 rows through
# cuBLAS, as before dsv4::linears took up to 64
SETTINGS = {"compile-step-graphs-mm-above-16": lambda: linears_max_rows(16)}


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", default="flash")
    p.add_argument("--layers", default="0,4,128",
                   help="compress ratios of the benchmarked stack; 'preset': all of --preset's layers")
    p.add_argument("--batch", default="1,8,64,256")
    p.add_argument("--context", default="4096,131072")
    p.add_argument("--ways", default="eager,compile,reduce-overhead,compile-step,compile-step-graphs,manual-graph")
    p.add_argument("--iters", type=int, default=50)
    p.add_argument("--profile", action="store_true", help="also profile each graph way (wall, GPU busy, kernels)")
    p.add_argument("--host", action="store_true", help="also each graph way's host µs a call, the GPU kept busy")
    hbm_tbps_argument(p)
    p.add_argument("--out", default=None, help="write results as JSON")
    p.add_argument("--plot", default=None, help="plot a saved JSON instead of running")
    p.add_argument("--png", default=None, help="the plot (default: --out's or --plot's name with .png, else "
                                               "bench_step.png)")
    args = p.parse_args()
    if args.png is None:
        saved = args.out or args.plot
        args.png = saved.removesuffix(".json") + ".png" if saved else "bench_step.png"
    return args


def _fill_valid_pages(cache: DSV4Cache) -> None:
    """Give every page of every pool valid FP8 content: store random keys into page 1 of each pool,
    then copy page 1 over all pages (cheap at any capacity)."""
    ops = torch.ops.dsv4
    for lc in cache.layers:
        pools = [(lc.swa_kv, PAGE_SIZE, 512, ops.store_kv)]
        if lc.ratio:
            pools.append((lc.extra_kv, lc.extra_page_size, 512, ops.store_kv))
        if lc.ratio == 4:
            pools.append((lc.index_k, 64, 128, ops.store_index_k))
        for buf, page_size, dim, store in pools:
            slots = torch.arange(page_size, 2 * page_size, device=buf.device)
            store(buf, slots, torch.randn(page_size, dim, device=buf.device, dtype=torch.bfloat16), page_size)
            buf[2:] = buf[1]
            buf[0] = buf[1]


def _setup(config: DSV4AttnConfig, max_batch: int, context: int, device) -> tuple[Engine, list[int]]:
    """An engine with ``max_batch`` requests of ``context`` tokens each; returns it and their rows."""
    max_seq = -(-(context + 1) // PAGE_SIZE) * PAGE_SIZE
    chunk = 16 * PAGE_SIZE
    cache = DSV4Cache(config, max_requests=max_batch, max_seq_len=max_seq,
                      num_swa_pages=max_batch * (chunk // PAGE_SIZE + 2) + 1, device=device)
    engine = Engine(DSV4AttentionStack(config, cache).reset_parameters(0).to(device))
    rows = [engine.admit() for _ in range(max_batch)]
    for row in rows:
        for lo in range(0, context, chunk):  # chunks keep transient SWA pages bounded
            engine.allocator.extend(row, min(chunk, context - lo))
    _fill_valid_pages(cache)
    return engine, rows


def _decode_step(engine: Engine, rows) -> tuple[torch.Tensor, StepInputs]:
    """``(x, step)``: one decode token per request of ``rows``, random ``x [B, hidden] bf16``."""
    step = engine.build_step(ForwardMode.DECODE, {r: 1 for r in rows})
    for r in rows:  # keep the context fixed: the same step is replayed every iteration
        engine.accept(r, 0, 1)
    x = torch.randn(step.num_tokens, engine.stack.config.hidden_size, device=engine.device, dtype=torch.bfloat16)
    return x, step


def _time(fn, iters: int) -> float:
    """Median µs per call, CUDA events around each call (after 3 warm-up calls)."""
    return _event_us(fn, calls=1, repeats=iters)


def _back_to_back(fn, iters: int) -> float:
    """µs per call of ``iters`` calls issued back to back (CUDA events around the loop, no wait
    between calls), median of 5 loops: what a call costs when the host runs ahead."""
    return _event_us(fn, calls=iters, repeats=5)


def _event_us(fn, calls: int, repeats: int) -> float:
    """Median over ``repeats`` of the µs per call of ``calls`` calls between two CUDA events,
    after 3 warm-up calls."""
    for _ in range(3):
        fn()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(calls):
            fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / calls)
    return statistics.median(times)


def _manual_graph(stack, x, step):
    """Static copies of the inputs, the eager step captured once, replay after copying inputs in."""
    static_x = x.clone()
    static = StepInputs(step.mode, *(t.clone() for t in step.tensors()))
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            stack(static_x, static, validate=False)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        stack(static_x, static, validate=False)

    def run():
        static_x.copy_(x)
        for dst, src in zip(static.tensors(), step.tensors()):
            dst.copy_(src)
        graph.replay()
    return run


def _measure(row: dict, way: str, fn, compiled, x, step, weight_bytes: int, args) -> None:
    """``way``'s figures at this step into ``row``: ``fn`` runs one step; ``compiled`` is the way's
    compiled step (None for eager and manual-graph)."""
    row[way] = _time(fn, args.iters)
    row[f"{way}_tbps"] = weight_bytes / row[way] / 1e6
    if args.host and way in GRAPH_WAYS:
        row[f"{way}_host_us"] = host_us_per_call(fn, args.iters)
    if args.host and way in STEP_GRAPH_WAYS:
        # the host's cost in a stream of steps: the calls against their captured graph alone
        row[f"{way}_back_to_back_us"] = _back_to_back(fn, args.iters)
        replay = compiled.graphs.captured(x, step).replay
        row[f"{way}_replay_us"] = _back_to_back(replay, args.iters)
        # the driver's own share of a call's host time: a bare replay queued the same way
        row[f"{way}_replay_host_us"] = host_us_per_call(replay, args.iters)
        # called with the graph's own static inputs: nothing copied
        static_x, static_step, _ = compiled.graphs.static_inputs(x, step)
        static_fn = lambda: compiled(static_x, static_step)  # noqa: E731
        row[f"{way}_static_us"] = _time(static_fn, args.iters)
        row[f"{way}_static_host_us"] = host_us_per_call(static_fn, args.iters)
    if args.profile and way in GRAPH_WAYS:
        row[f"{way}_profile"] = profile_steps(lambda n: [fn() for _ in range(n)], args.iters, top=8)


def run(args) -> list[dict]:
    device = "cuda"
    config = DSV4AttnConfig.from_name(args.preset)
    if args.layers != "preset":
        config = config.with_(compress_ratios=tuple(int(r) for r in args.layers.split(",")))
    batches = [int(b) for b in args.batch.split(",")]
    ways = args.ways.split(",")
    results = []
    torch.set_grad_enabled(False)
    for context in (int(c) for c in args.context.split(",")):
        engine, rows = _setup(config, max(batches), context, device)
        stack = engine.stack
        compiled = {"compile": torch.compile(stack, fullgraph=True, dynamic=False),
                    "reduce-overhead": torch.compile(stack, mode="reduce-overhead", fullgraph=True,
                                                     dynamic=False),
                    "compile-step": compile_step(stack, mode="reduce-overhead"),
                    "compile-step-graphs": compile_step(stack, mode="reduce-overhead", cuda_graphs="step"),
                    "compile-step-graphs-pdl": compile_step(stack, mode="reduce-overhead", cuda_graphs="step",
                                                            options={"triton.enable_pdl": True}),
                    "compile-step-graphs-mm-above-16": compile_step(stack, mode="reduce-overhead",
                                                                    cuda_graphs="step"),
                    **{way: compile_step(stack, mode="reduce-overhead", cuda_graphs="step",
                                         passes=DSV4PassManager(passes())) for way, passes in PASSES.items()}}
        weight_bytes = sum(p.numel() * p.element_size() for p in stack.parameters())
        floor_us = weight_bytes / (args.hbm_tbps * 1e12) * 1e6
        for b in batches:
            x, step = _decode_step(engine, rows[:b])
            row = {"context": context, "batch": b}
            for way in ways:
                if way == "eager":
                    fn = lambda s=stack: s(x, step, validate=False)  # noqa: E731
                elif way == "manual-graph":
                    fn = _manual_graph(stack, x, step)
                else:
                    fn = lambda c=compiled[way]: c(x, step)  # noqa: E731
                with SETTINGS.get(way, nullcontext)():
                    _measure(row, way, fn, compiled.get(way), x, step, weight_bytes, args)
            row["floor_us"] = floor_us
            base = row.get("manual-graph")
            print(f"ctx {context:>7} b {b:>4}  floor {floor_us:.1f}us  " + "  ".join(
                f"{w} {row[w]:9.1f}us" + (f" ({row[w] / base:.2f}x)" if base else "") for w in ways), flush=True)
            for way in ways:
                if (prof := row.get(f"{way}_profile")) is not None:
                    print(f"    {way}: wall {prof['wall_us']:.1f}us, GPU busy {prof['gpu_busy_us']:.1f}us, active "
                          f"{prof['gpu_active_us']:.1f}us, host "
                          f"overhead {prof['host_overhead_us']:.1f}us, {prof['kernels']:.0f} kernels/step; top: "
                          + ", ".join(f"{k['name'][:40]} {k['us_per_step']:.1f}" for k in prof["top"][:5]),
                          flush=True)
                    if prof["copies"]:
                        print(f"    {way}: copy work/step: " + ", ".join(
                            f"{c['name']} {c['calls_per_step']:.0f}x {c['us_per_step']:.1f}us" for c in prof["copies"]),
                            flush=True)
                if (host := row.get(f"{way}_host_us")) is not None:
                    print(f"    {way}: host {host:.1f}us a call (GPU kept busy)", flush=True)
                if (replay := row.get(f"{way}_replay_us")) is not None:
                    print(f"    {way}: back to back {row[f'{way}_back_to_back_us']:.1f}us a call, its graph's "
                          f"replays alone {replay:.1f}us; with its static inputs {row[f'{way}_static_us']:.1f}us "
                          f"a waited call, host {row[f'{way}_static_host_us']:.1f}us (a bare replay's "
                          f"{row[f'{way}_replay_host_us']:.1f}us)", flush=True)
            results.append(row)
        del stack, engine, compiled
        torch._dynamo.reset()
        torch.cuda.empty_cache()
    return results


def plot(results: list[dict], png: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    contexts = sorted({r["context"] for r in results})
    ways = [k for k in results[0] if k not in ("context", "batch", "floor_us")
            and not k.endswith(("_tbps", "_profile", "_host_us"))]
    fig, axes = plt.subplots(1, len(contexts), figsize=(6 * len(contexts), 4), squeeze=False)
    for ax, ctx in zip(axes[0], contexts):
        rows = [r for r in results if r["context"] == ctx]
        for way in ways:
            ax.plot([r["batch"] for r in rows], [r[way] for r in rows], marker="o", label=way)
        ax.set(xscale="log", yscale="log", xlabel="batch (requests)", ylabel="µs per decode step",
               title=f"context {ctx // 1024}k")
        ax.legend()
    fig.tight_layout()
    fig.savefig(png, dpi=120)


def main() -> None:
    args = parse_args()
    if args.plot:
        with open(args.plot) as f:
            plot(json.load(f)["results"], args.png)
        return
    results = run(args)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({**header("cuda", args), "results": results}, f, indent=1)
    try:
        plot(results, args.png)
    except ImportError:
        print("matplotlib missing: plot later with --plot")


if __name__ == "__main__":
    main()
