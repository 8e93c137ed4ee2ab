"""Whole-model speed: a transformers DeepSeek V4 model, its own eager code against the backend,
eager and compiled, side by side in one run.

Usage:
    python benchmarks/bench_model.py --out benchmarks/results/bench_model_<date>.json \\
        --plot benchmarks/results/bench_model_<date>.png                  # on a CUDA machine
    python benchmarks/bench_model.py --tiny --device cpu                 # smoke check, any machine
    python benchmarks/bench_model.py --replot run.json --plot run.png    # plot a saved run

``--skip-compile-time`` leaves out the two compile processes (most of a run's time);
``--compile-time-only`` runs only them. ``--skip-hf-eager`` / ``--hf-max-batch`` leave out or cap
the transformers eager way.

The model: ``DeepseekV4ForCausalLM`` with the Flash preset's attention dimensions (hidden 4096,
64 heads of 512, q rank 1024, 8 output groups of rank 1024, indexer 64 heads x 128, top-k 512,
window 128, compressed-branch RoPE with YaRN as the released Flash config), a few layers of every
type (``--layers``: compression ratios, default sliding / CSA / HCA / CSA), the MoE shrunk
(``--experts`` of ``--expert-dim``, ``--active-experts`` per token), the full vocabulary; bf16
with the modules transformers keeps in fp32 in fp32, random weights drawn on the device.

Ways (the same model and weights; ``hf_eager`` first, the others in ``--ways`` order, one process:
a process's first compiled way has run faster than those after it, so compare two ways in both
orders or in separate processes):
    hf_eager       transformers' own forward with its DynamicCache, one token per step
                   (``model(ids, past_key_values=cache, use_cache=True)``), as a generate loop runs it
    backend_eager  the model on the backend, eager: ``backend(input_ids, step, logit_rows)``
    compiled       ``compile_step(backend, mode="reduce-overhead")``: one graph, CUDA graphs
    compiled_grouped  compiled with transformers' ``grouped_mm`` experts in place of the
                   backend's (``dsv4::routed_experts``); not in the default ``--ways``
    compiled_unfused_linears  compiled without ``FuseSharedInputLinearsPass`` (each projection
                   its own cuBLAS call, not one ``dsv4::linears`` launch per activation); not in
                   the default ``--ways``
    compiled_lone_linears_cublas  compiled with ``FuseSharedInputLinearsPass(lone_min_k=None)``
                   (``o_b_proj`` and the ``lm_head`` through cuBLAS); not in the default ``--ways``
    compiled_unfused_norm_rope  compiled without ``FuseNormRopePass`` (each query / key norm +
                   RoPE as Inductor compiles it); not in the default ``--ways``
    compiled_unfused_key_store  compiled without ``FuseKeyStorePass`` (each key's norm + RoPE and its
                   cache write two launches); not in the default ``--ways``
    compiled_lean  compiled with ``model_guards=False`` (no Dynamo guards on the model's
                   parameters: less host time per call); not in the default ``--ways``
    compiled_step_graphs  compiled with ``cuda_graphs="step"``: the whole step captured as one CUDA
                   graph per input signature, replayed without entering Dynamo; not in the default
                   ``--ways``
    compiled_step_graphs_pdl  the same with Inductor's kernels under programmatic dependent launch
                   (``triton.enable_pdl``); not in the default ``--ways``
    compiled_step_graphs_combo  the same with Inductor's combo kernels (``combo_kernels``: independent
                   kernels of the step, such as the hash layers' expert look-ups, share a launch);
                   not in the default ``--ways``
    compiled_step_graphs_hc_post_apart  whole-step graphs with every ``dsv4::hc_post_pre`` run as
                   ``hc_post`` then ``hc_pre`` (3 launches, as above four tokens), for a side-by-side
                   with ``compiled_step_graphs`` at one to four tokens; not in the default ``--ways``
    compiled_step_graphs_no_prefetch  whole-step graphs with the projections (``dsv4::linears``,
                   ``dsv4::grouped_linear``) launched without PDL and their weight prefetch; not in
                   the default ``--ways``
    compiled_step_graphs_experts_no_prefetch  whole-step graphs with the routed experts' and the
                   learned router's launches without PDL and their weight prefetch; not in the
                   default ``--ways``
    compiled_step_graphs_all_lone_linears  whole-step graphs with every lone product (``q_b_proj``
                   and the shared expert's ``down_proj`` too, K of 1024 / 2048) through
                   ``dsv4::linears`` and its weight prefetch, not cuBLAS; not in the default ``--ways``
    compiled_step_graphs_no_split_k  whole-step graphs with ``dsv4::linears`` never splitting K (one
                   program per column tile, small groups too); not in the default ``--ways``
    compiled_step_graphs_moe_apart  whole-step graphs with each MoE layer run as the block runs it
                   (its router's product, the routed experts' launches, the shared expert's three
                   products) instead of around ``dsv4::moe_experts``; not in the default ``--ways``
    compiled_step_graphs_hash_router_apart  whole-step graphs with each hash-routed MoE layer's router
                   product run by its gate, a launch of its own, instead of inside
                   ``dsv4::moe_experts`` (``hf_experts.HASH_ROUTER_IN_OP`` off); not in the default
                   ``--ways``
    compiled_step_graphs_weights_then_sum  whole-step graphs with each MoE layer dividing each
                   routing weight by the sum of the scores before the weighted sum, as transformers
                   does (``hf_experts.NORMALISE_AFTER_SUM`` off); not in the default ``--ways``
    compiled_step_graphs_router_gate  whole-step graphs with each learned router run as
                   transformers' gate (``hf_experts.LEARNED_ROUTER_OP`` off), not as
                   ``dsv4::router_topk``; not in the default ``--ways``
    compiled_step_graphs_switches_off  whole-step graphs with the two switches above off at once;
                   not in the default ``--ways``
    compiled_step_graphs_norm_apart  whole-step graphs with each block's input norm and the final norm
                   run as the norm module on the output of the mHC op of its collapse, not inside that op
                   (``hf_hyper_connection.NORM_IN_OP`` off); not in the default ``--ways``
    compiled_step_graphs_router_topk  whole-step graphs with ``ReplaceShortTopkPass`` added to the
                   default passes (the learned routers' ``aten.topk`` as ``dsv4::topk_indices``); not in
                   the default ``--ways``
    compiled_step_graphs_entry_store_apart  whole-step graphs without ``FuseEntryStorePass`` (each
                   compressor's entries written by a ``store_kv`` / ``store_index_k`` launch of their
                   own, not by ``dsv4::compress_kv_store``'s entry kernel); not in the default ``--ways``
    compiled_step_graphs_rotation_apart  whole-step graphs without ``FuseAttentionInverseRopePass``
                   (each attention output rotated back by a ``rope_tail`` launch before its grouped
                   product, not in the attention's split combine); not in the default ``--ways``
    compiled_step_graphs_side_stream  whole-step graphs with ``OverlapCacheWritesPass`` added to the
                   default passes (each layer's cache writes on a second stream, beside the query's
                   products); not in the default ``--ways``
    compiled_step_graphs_q_norm_folded  whole-step graphs with each query latent's norm folded into
                   its ``q_b_proj`` products' ``dsv4::linears`` launch
                   (``FuseSharedInputLinearsPass(fold_input_norm=True)``), not a launch of its own;
                   not in the default ``--ways``
    compiled_step_graphs_collapse_linears  whole-step graphs with ``FuseCollapseLinearsPass`` added to
                   the default passes (each collapse that feeds products made in the products'
                   launch, the hc op's finishing launch gone); not in the default ``--ways``
    compiled_step_graphs_collapse_q_norm_folded  both of the two ways above; not in the default
                   ``--ways``
    compiled_step_graphs_q_norm_folded_no_prefetch  the folded norm, every ``dsv4::linears`` launch
                   without PDL and its weight prefetch (to compare with
                   ``compiled_step_graphs_no_prefetch``); not in the default ``--ways``

Measured:
    prefill    one step over ``b`` whole prompts of ``--prompt-len`` tokens (``--prefill-batches``),
               logits of each prompt's last token; median over ``--prefill-iters`` timed calls
               after one warm-up (two for compiled), fresh requests each call
    decode     each request's prompt is prefilled first (backend: eager steps of at most
               ``--fill-tokens`` tokens; transformers: chunks of that many tokens over the batch),
               then ``--warmup`` + ``--steps`` greedy decode steps of one token per request; the
               time per step is the CUDA-event time of the ``--steps`` timed steps over their count
               (step inputs built before timing, next tokens chosen on the device by
               ``sampling.greedy_tokens``, every way alike)
    compile    first-call wall time of each frame of ``compile_step`` (prefill b = 1, decode b = 1,
               decode b = 2) in a fresh process with empty Inductor and Triton caches (cold), then
               in a second fresh process with the caches the first one filled (warm)
    bandwidth  weight bytes a decode step reads / its time (gpt-fast style): every parameter except
               the embedding table (b rows of it are read), and of each MoE layer's routed experts
               the expected number a batch of b uniformly routed tokens reaches; the floors divide
               all parameter bytes, and the bytes read, by ``--hbm-tbps`` (the GPU's peak unless given)
    --host     per compiled way and decode batch: the host's own µs per step with the GPU kept busy
               (``testing.bench.host_us_per_call``), and the µs per step of a loop that reads each
               step's next tokens on the host before it issues the next step (as a generation loop
               checking stop tokens does: host time and GPU time add up)
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from contextlib import ExitStack, nullcontext

import torch
from torch._dynamo.utils import counters
from transformers import DeepseekV4Config, DynamicCache

from dsv4_compile.compile import compile_step
from dsv4_compile.config import PAGE_SIZE
from dsv4_compile.fx_passes import (DSV4PassManager, FuseAttentionInverseRopePass, FuseCollapseLinearsPass,
                                    FuseEntryStorePass, FuseKeyStorePass, FuseNormRopePass, FuseSharedInputLinearsPass,
                                    OverlapCacheWritesPass, ReplaceShortTopkPass)
from dsv4_compile.fx_passes.pass_manager import default_passes
from dsv4_compile.model import ModelBackend, enable
from dsv4_compile.sampling import greedy_tokens
from dsv4_compile.step import ForwardMode, StepInputs
from dsv4_compile.testing.bench import (compiled_ratios, expert_weight_prefetch, hash_router_in_op, hbm_tbps_argument,
                                        header, host_us_per_call, learned_router_op, linears_split_k, moe_in_op,
                                        norm_in_hc_op, normalise_after_sum, passes_configured, passes_without,
                                        posted_max_tokens, profile_steps, wall_call, weight_prefetch)
from dsv4_compile.testing.random_model import random_hf_model


def _without(kind: type) -> Callable[[], list]:
    """The default passes less the one of type ``kind``."""
    return lambda: passes_without(kind)


def _linears_pass(**settings) -> Callable[[], list]:
    """The default passes with ``FuseSharedInputLinearsPass(**settings)``: ``lone_min_k`` (products
    with no other of their input through ``dsv4::linears`` from that K on; None: all of them left
    to cuBLAS), ``fold_input_norm``."""
    return lambda: passes_configured(FuseSharedInputLinearsPass, **settings)


# compiled with the default passes less one, or one of them configured otherwise
PASS_VARIANTS = {"compiled_unfused_linears": _without(FuseSharedInputLinearsPass),
                 "compiled_lone_linears_cublas": _linears_pass(lone_min_k=None),
                 "compiled_unfused_norm_rope": _without(FuseNormRopePass),
                 "compiled_unfused_key_store": _without(FuseKeyStorePass)}
LAYER_TYPES = {0: "sliding_attention", 4: "compressed_sparse_attention", 128: "heavily_compressed_attention"}
# The released Flash config's compressed-branch RoPE (the main branch has no scaling).
FLASH_YARN = {"rope_type": "yarn", "factor": 16.0, "original_max_position_embeddings": 65536,
              "beta_fast": 32.0, "beta_slow": 1.0}
FLASH_DIMS = dict(vocab_size=129280, hidden_size=4096, num_attention_heads=64, head_dim=512, q_lora_rank=1024,
                  o_groups=8, o_lora_rank=1024, index_n_heads=64, index_head_dim=128, index_topk=512,
                  sliding_window=128)
TINY_DIMS = dict(FLASH_DIMS, vocab_size=512, hidden_size=256, num_attention_heads=8, q_lora_rank=128,
                 o_groups=2, o_lora_rank=64, index_n_heads=8, index_topk=64)
# --tiny: defaults of a CPU smoke run (explicit flags still win); prefill only at b = 2 so that the
# compiled way compiles two frames (b >= 2, and decode b = 1), not three
TINY_RUN = dict(layers="0,4,128", experts=4, expert_dim=128, prompt_len=256, batches="1,2",
                prefill_batches="2", steps=3, prefill_iters=1)
PROBE_TAG = "COMPILE_PROBE "


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--layers", help="compression ratio of each layer (0 sliding, 4 CSA, 128 HCA); default 0,4,128,4")
    p.add_argument("--experts", type=int, help="routed experts per MoE layer (default 8)")
    p.add_argument("--expert-dim", type=int, help="intermediate size of each expert (default 2048)")
    p.add_argument("--active-experts", type=int, default=2, help="routed experts per token")
    p.add_argument("--prompt-len", type=int, help="tokens of each prompt (default 4096)")
    p.add_argument("--batches", help="decode batch sizes (default 1,8,64)")
    p.add_argument("--prefill-batches", help="prompts per prefill step (default 1,8; '' for none)")
    p.add_argument("--steps", type=int, help="timed decode steps (default 32)")
    p.add_argument("--warmup", type=int, default=3, help="decode steps before timing")
    p.add_argument("--prefill-iters", type=int, help="timed prefill calls (default 3)")
    p.add_argument("--fill-tokens", type=int, default=32768, help="most tokens per step while filling the cache")
    p.add_argument("--hf-max-batch", type=int, default=None, help="largest decode batch run through hf_eager")
    p.add_argument("--ways", default=",".join(DEFAULT_WAYS))
    p.add_argument("--skip-hf-eager", action="store_true")
    p.add_argument("--skip-compile-time", action="store_true", help="no cold / warm compile processes")
    p.add_argument("--compile-time-only", action="store_true", help="only the cold / warm compile processes")
    p.add_argument("--tiny", action="store_true", help="hidden 256, 8 heads, vocab 512: a CPU smoke check")
    p.add_argument("--device", default="cuda")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--profile", action="store_true",
                   help="profile the compiled decode steps: GPU busy time, host overhead, kernels per step")
    p.add_argument("--host", action="store_true",
                   help="compiled decode: host µs per step (GPU kept busy) and µs per step read back on the host")
    hbm_tbps_argument(p)
    p.add_argument("--out", help="write the results as JSON; rewritten after each way, \"finished\" false until "
                                 "the run ends")
    p.add_argument("--plot", help="write a PNG of the results")
    p.add_argument("--replot", help="plot a saved JSON (with --plot) instead of running")
    p.add_argument("--compile-probe", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    defaults = dict(layers="0,4,128,4", experts=8, expert_dim=2048, prompt_len=4096, batches="1,8,64",
                    prefill_batches="1,8", steps=32, prefill_iters=3)
    for name, value in {**defaults, **(TINY_RUN if args.tiny else {})}.items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    args.ways = [w for w in args.ways.split(",") if not (args.skip_hf_eager and w == "hf_eager")]
    if unknown := set(args.ways) - set(WAYS):
        p.error(f"--ways: unknown {sorted(unknown)}; choose from {WAYS}")
    return args


def _ints(csv: str) -> list[int]:
    """``"1,8"`` -> ``[1, 8]``; ``""`` -> ``[]`` (e.g. no prefill measurement)."""
    return [int(v) for v in csv.split(",") if v]


# -- model -----------------------------------------------------------------------------------------

def model_config(args) -> DeepseekV4Config:
    """The benchmarked ``DeepseekV4Config``: Flash attention dimensions (tiny ones with ``--tiny``),
    ``--layers`` / ``--experts`` / ``--expert-dim`` / ``--active-experts``, Flash defaults otherwise."""
    ratios = _ints(args.layers)
    if unknown := set(ratios) - set(LAYER_TYPES):
        raise SystemExit(f"--layers: ratios must be in {sorted(LAYER_TYPES)}, got {sorted(unknown)}")
    return DeepseekV4Config(**(TINY_DIMS if args.tiny else FLASH_DIMS), num_hidden_layers=len(ratios),
                            layer_types=[LAYER_TYPES[r] for r in ratios], n_routed_experts=args.experts,
                            num_experts_per_tok=args.active_experts, moe_intermediate_size=args.expert_dim,
                            rope_parameters=dict(FLASH_YARN))


def weight_bytes(model) -> dict[str, int]:
    """Parameter bytes: ``total``, ``embedding`` (the input table), ``experts`` (routed, all layers)."""
    parts = {"total": 0, "embedding": 0, "experts": 0}
    for name, p in model.named_parameters():
        n = p.numel() * p.element_size()
        parts["total"] += n
        parts["embedding"] += n * name.endswith("embed_tokens.weight")
        parts["experts"] += n * (".mlp.experts." in name)
    return parts


def decode_read_bytes(parts: dict[str, int], config: DeepseekV4Config, batch: int) -> float:
    """Weight bytes one decode step of ``batch`` tokens reads: all but the embedding table, with each
    MoE layer's routed experts scaled by the expected fraction that ``batch`` tokens routed
    uniformly to ``top_k`` of ``E`` experts reach, ``1 - (1 - top_k / E) ** batch``."""
    e, k = config.n_routed_experts, config.num_experts_per_tok
    reached = 1.0 - (1.0 - k / e) ** batch
    return parts["total"] - parts["embedding"] - parts["experts"] * (1.0 - reached)


def prompts(config: DeepseekV4Config, batch: int, length: int, seed: int, device) -> torch.Tensor:
    """``[batch, length]`` int64 random token ids, seeded by ``seed`` and ``batch``."""
    gen = torch.Generator().manual_seed(seed * 1000 + batch)
    return torch.randint(0, config.vocab_size, (batch, length), generator=gen).to(device)


# -- timing ----------------------------------------------------------------------------------------

def elapsed_ms(fn: Callable[[], object], device: torch.device) -> float:
    """Milliseconds ``fn()`` takes on ``device``: CUDA events around it on CUDA (the device timeline,
    host gaps included), wall time otherwise."""
    if device.type != "cuda":
        start = time.perf_counter()
        fn()
        return 1e3 * (time.perf_counter() - start)
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end)


# -- transformers eager ----------------------------------------------------------------------------

def hf_forward(model, ids: torch.Tensor, cache: DynamicCache) -> torch.Tensor:
    """One forward of ``ids [b, S]`` appended to ``cache``; the next greedy tokens ``[b, 1]``."""
    logits = model(input_ids=ids, past_key_values=cache, use_cache=True, logits_to_keep=1).logits
    return greedy_tokens(logits[:, -1])[:, None]


def hf_prefill_ms(model, tokens: torch.Tensor) -> float:
    """One prefill forward of the whole prompts ``tokens [b, P]`` into a fresh cache."""
    return elapsed_ms(lambda: hf_forward(model, tokens, DynamicCache(config=model.config)), tokens.device)


def hf_decode_us(model, tokens: torch.Tensor, args) -> float:
    """µs per decode step after prefilling ``tokens [b, P]`` in chunks of at most ``--fill-tokens``
    tokens over the batch (a multiple of 128 per prompt)."""
    b, length = tokens.shape
    chunk = min(length, max(128, args.fill_tokens // b // 128 * 128))
    cache = DynamicCache(config=model.config)
    for lo in range(0, length, chunk):
        ids = hf_forward(model, tokens[:, lo:lo + chunk], cache)
    for _ in range(args.warmup):
        ids = hf_forward(model, ids, cache)

    def steps():
        nonlocal ids
        for _ in range(args.steps):
            ids = hf_forward(model, ids, cache)

    return 1e3 * elapsed_ms(steps, tokens.device) / args.steps


# -- the backend -----------------------------------------------------------------------------------

StepFn = Callable[[torch.Tensor, StepInputs, torch.Tensor], torch.Tensor]


def logit_rows(rows: list[int], device) -> torch.Tensor:
    """``rows`` as int64, padded with row 0 to at least 2 rows (a compiled step keeps R >= 2)."""
    return torch.tensor(rows + [0] * (2 - len(rows)), dtype=torch.int64, device=device)


def prefill_inputs(backend: ModelBackend, tokens: torch.Tensor) -> tuple[list[int], tuple]:
    """Admit one request per prompt of ``tokens [b, P]`` and allocate its positions; returns the
    rows and ``(input_ids, step, logit_rows)`` of one prefill step over all of them."""
    alloc, device = backend.allocator, tokens.device
    b, length = tokens.shape
    rows = [alloc.admit() for _ in range(b)]
    loc = torch.cat([alloc.extend(r, length) for r in rows])
    step = StepInputs.make(ForwardMode.EXTEND, rows, [length] * b, [length] * b, loc, device=device)
    last = logit_rows([(i + 1) * length - 1 for i in range(b)], device)
    return rows, (tokens.reshape(-1), step, last)


def backend_prefill_ms(backend: ModelBackend, fn: StepFn, tokens: torch.Tensor, calls: int) -> list[float]:
    """Times of ``calls`` prefill steps of ``tokens [b, P]``, each over fresh requests."""
    times = []
    for _ in range(calls):
        rows, inputs = prefill_inputs(backend, tokens)
        times.append(elapsed_ms(lambda: fn(*inputs), tokens.device))
        for r in rows:
            backend.allocator.free(r)
    return times


def fill(backend: ModelBackend, tokens: torch.Tensor, max_tokens: int) -> tuple[list[int], torch.Tensor]:
    """Prefill one request per prompt of ``tokens [b, P]`` with eager steps of at most
    ``max_tokens`` tokens (whole prompts); returns the rows and each one's next token ``[b]``."""
    b, length = tokens.shape
    group = max(1, max_tokens // length)
    rows, next_ids = [], []
    for lo in range(0, b, group):
        new_rows, inputs = prefill_inputs(backend, tokens[lo:lo + group])
        rows += new_rows
        next_ids.append(backend(*inputs)[:len(new_rows)].argmax(-1))
    return rows, torch.cat(next_ids)


def decode_steps(backend: ModelBackend, rows: list[int], count: int) -> list[StepInputs]:
    """``count`` consecutive decode steps of one token per request of ``rows``, positions
    allocated now (so building a step costs nothing while timing)."""
    alloc, device = backend.allocator, backend.cache.device
    start = [alloc.seq_len(r) for r in rows]
    loc = torch.stack([alloc.extend(r, count) for r in rows], dim=1)  # [count, b]
    return [StepInputs.make(ForwardMode.DECODE, rows, [n + k + 1 for n in start], [1] * len(rows), loc[k],
                            device=device) for k in range(count)]


def backend_decode_us(backend: ModelBackend, fn: StepFn, tokens: torch.Tensor, args, profile: bool = False,
                      host: bool = False) -> tuple[float, dict]:
    """µs per decode step of ``fn`` after filling one request per prompt of ``tokens [b, P]``, and
    extra figures over further steps: with ``profile`` ``"profile"`` (:func:`profile_steps`), with
    ``host`` ``"host_us"`` (the host's µs per step, the GPU kept busy) and ``"synced_us"`` (µs per
    step when each step's tokens are read on the host before the next step is issued)."""
    b = tokens.shape[0]
    start = time.perf_counter()
    rows, ids = fill(backend, tokens, args.fill_tokens)
    steps = iter(decode_steps(backend, rows, args.warmup + args.steps * (1 + profile + 2 * host)))
    out_rows = logit_rows(list(range(b)), tokens.device)

    def run(count: int, synced: bool = False) -> None:
        nonlocal ids
        for _ in range(count):
            ids = greedy_tokens(fn(ids, next(steps), out_rows)[:b])
            if synced:
                ids.tolist()

    filled = time.perf_counter()
    # where a run's first minutes go, each stage as it ends (a stalled run shows where): on a fresh
    # machine the eager prefill and a compiled way's first step compile every kernel (and capture
    # the graphs)
    print(f"         b {b:>3}: prompts filled in {filled - start:.1f} s", flush=True)
    more = max(args.warmup - 1, 0)
    run(args.warmup - more)
    ids.tolist()
    first = time.perf_counter()
    run(more)
    ids.tolist()
    print(f"         b {b:>3}: first step in {first - filled:.1f} s, {more} more warm-up steps in "
          f"{time.perf_counter() - first:.1f} s", flush=True)
    us = 1e3 * elapsed_ms(lambda: run(args.steps), tokens.device) / args.steps
    extra = {}
    if host:  # before profiling: the profiler slows the launches that follow it
        extra["host_us"] = host_us_per_call(lambda: run(1), args.steps)
        extra["synced_us"] = 1e3 * elapsed_ms(lambda: run(args.steps, synced=True), tokens.device) / args.steps
    if profile:
        extra["profile"] = profile_steps(run, args.steps, top=None)
    for r in rows:
        backend.allocator.free(r)
    return us, extra


def make_backend(model, args, batches: list[int]) -> ModelBackend:
    """The backend with room for the largest batch at prompt + decode length."""
    need = args.prompt_len + args.warmup + args.steps + 1
    return enable(model, max_requests=max(batches), max_seq_len=-(-need // PAGE_SIZE) * PAGE_SIZE)


# -- compile time ----------------------------------------------------------------------------------

def compile_probe(args) -> dict[str, float]:
    """First-call wall seconds of a fresh ``compile_step``'s first calls (run in its own process):
    prefill b = 1 (which compiles the step's frame), decode b = 1 and decode b = 2 (the same frame:
    request and row counts are dynamic; with CUDA-graph trees each records its graph)."""
    device = torch.device(args.device)
    model = random_hf_model(model_config(args), seed=args.seed, device=device)
    backend = make_backend(model, args, [2])
    fn = compile_step(backend, mode="reduce-overhead")
    tokens = prompts(model.config, 2, args.prompt_len, args.seed, device)
    first, inputs = prefill_inputs(backend, tokens[:1])
    times = {"prefill_b1": wall_call(lambda: fn(*inputs), device)[1]}
    step = decode_steps(backend, first, 1)[0]
    times["decode_b1"] = wall_call(lambda: fn(tokens[0, :1], step, logit_rows([0], device)), device)[1]
    second, inputs = prefill_inputs(backend, tokens[1:])
    fn(*inputs)  # the prefill frame again
    step = decode_steps(backend, first + second, 1)[0]
    times["decode_b2"] = wall_call(lambda: fn(tokens[:, 0], step, logit_rows([0, 1], device)), device)[1]
    times["total"] = sum(times.values())
    return times


def compile_times(args) -> dict[str, dict[str, float]]:
    """Cold and warm compile times: :func:`compile_probe` in two fresh processes sharing new, empty
    Inductor and Triton cache directories."""
    cache = tempfile.mkdtemp(prefix="bench_model_inductor_")
    dirs = {"TORCHINDUCTOR_CACHE_DIR": cache, "TRITON_CACHE_DIR": os.path.join(cache, "triton")}
    result = {"cache_dir": cache}
    for kind in ("cold", "warm"):
        proc = subprocess.run([sys.executable, __file__, *sys.argv[1:], "--compile-probe"],
                              env={**os.environ, **dirs}, capture_output=True, text=True)
        lines = [ln for ln in proc.stdout.splitlines() if ln.startswith(PROBE_TAG)]
        if proc.returncode or not lines:
            raise RuntimeError(f"compile probe ({kind}) failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}")
        result[kind] = json.loads(lines[-1][len(PROBE_TAG):])
        print(f"compile {kind}: " + "  ".join(f"{k} {v:.1f}s" for k, v in result[kind].items()), flush=True)
    os.environ.update(dirs)  # this process compiles warm too: its timings are not compile times
    return result


# -- the run ---------------------------------------------------------------------------------------

def measure_hf(model, args, results: dict) -> None:
    """The transformers eager rows of ``results`` (run before the backend changes the experts
    implementation); a batch that runs out of memory is recorded as None."""
    device = torch.device(args.device)
    results["hf_experts_implementation"] = model.config._experts_implementation
    for b in _ints(args.prefill_batches):
        tokens = prompts(model.config, b, args.prompt_len, args.seed, device)
        results["prefill"][b]["hf_eager"] = _unless_oom(
            lambda: statistics.median([hf_prefill_ms(model, tokens) for _ in range(1 + args.prefill_iters)][1:]))
        _report("prefill", b, "hf_eager", results["prefill"][b]["hf_eager"], "ms")
    for b in _ints(args.batches):
        if args.hf_max_batch is not None and b > args.hf_max_batch:
            continue
        tokens = prompts(model.config, b, args.prompt_len, args.seed, device)
        results["decode"][b]["hf_eager"] = _unless_oom(lambda: hf_decode_us(model, tokens, args))
        _report("decode", b, "hf_eager", results["decode"][b]["hf_eager"], "us/step")


def measure_backend(backend: ModelBackend, way: str, fn: StepFn, args, results: dict) -> None:
    """The ``way`` rows of ``results``: prefill, then decode at each batch size."""
    device = torch.device(args.device)
    warm = 2 if way.startswith("compiled") else 1  # CUDA-graph trees: a warm-up run, then the recording
    for b in _ints(args.prefill_batches):
        tokens = prompts(backend.model.config, b, args.prompt_len, args.seed, device)
        ms = statistics.median(backend_prefill_ms(backend, fn, tokens, warm + args.prefill_iters)[warm:])
        results["prefill"][b][way] = ms
        _report("prefill", b, way, ms, "ms")
    for b in _ints(args.batches):
        tokens = prompts(backend.model.config, b, args.prompt_len, args.seed, device)
        compiled_cuda = way.startswith("compiled") and device.type == "cuda"
        results["decode"][b][way], extra = backend_decode_us(backend, fn, tokens, args, args.profile and compiled_cuda,
                                                             args.host and compiled_cuda)
        _report("decode", b, way, results["decode"][b][way], "us/step")
        if "host_us" in extra:
            results.setdefault("host", {}).setdefault(way, {})[b] = {k: extra[k] for k in ("host_us", "synced_us")}
            print(f"host     b {b:>3} {way}: {extra['host_us']:.1f} us of host time a step (GPU kept busy); "
                  f"{extra['synced_us']:.1f} us a step read back on the host", flush=True)
        if profiled := extra.get("profile"):
            results.setdefault("profile", {}).setdefault(way, {})[b] = profiled
            print(f"profile  b {b:>3} {way}: wall {profiled['wall_us']:.0f} us, GPU busy "
                  f"{profiled['gpu_busy_us']:.0f} us, active {profiled['gpu_active_us']:.0f} us, idle "
                  f"{profiled['gpu_idle_us']:.0f} us, {profiled['kernels']:.0f} kernels/step; top kernels "
                  "(critical-path us, summed us, calls):", flush=True)
            for k in profiled["top"][:25]:
                print(f"    {k['critical_us_per_step']:8.1f} {k['us_per_step']:8.1f} us  x{k['calls_per_step']:5.1f}  "
                      f"{k['name'][:90]}", flush=True)
            first_way, first = next((w, p[b]) for w, p in results["profile"].items() if b in p)
            if first_way != way:
                for line in kernel_changes(first["top"], profiled["top"]):
                    print(f"    against {first_way}: {line}", flush=True)


def kernel_changes(before: list[dict], after: list[dict]) -> list[str]:
    """The kernels whose launches a step changed between two profiles' ``top`` lists (every
    kernel, as ``profile_steps(..., top=None)`` gives them): ``"+1.0 name"`` per kernel name, by
    calls per step, so that a way's switch shows which launches it took away or added."""
    calls = {}
    for sign, top in ((-1, before), (1, after)):
        for k in top:
            calls[k["name"]] = calls.get(k["name"], 0.0) + sign * k["calls_per_step"]
    return [f"{n:+.1f} {name[:90]}" for name, n in sorted(calls.items(), key=lambda kv: kv[1]) if abs(n) > 0.05]


def _unless_oom(fn: Callable[[], float]) -> float | None:
    try:
        return fn()
    except torch.OutOfMemoryError:
        torch.cuda.empty_cache()
        return None


def _report(kind: str, b: int, way: str, value: float | None, unit: str) -> None:
    print(f"{kind:8s} b {b:>3} {way:14s} " + ("out of memory" if value is None else f"{value:10.1f} {unit}"),
          flush=True)


def run(args) -> dict:
    device = torch.device(args.device)
    results = {"compile": None if args.skip_compile_time or "compiled" not in args.ways else compile_times(args)}
    torch.set_grad_enabled(False)
    model = random_hf_model(model_config(args), seed=args.seed, device=device)
    parts = weight_bytes(model)
    results.update(weights=parts, prefill={b: {} for b in _ints(args.prefill_batches)},
                   decode={b: {} for b in _ints(args.batches)})
    print(f"parameters {parts['total'] / 2**30:.2f} GiB (embedding {parts['embedding'] / 2**30:.2f}, "
          f"routed experts {parts['experts'] / 2**30:.2f})", flush=True)
    if "hf_eager" in args.ways:
        measure_hf(model, args, results)
        if device.type == "cuda":
            torch.cuda.empty_cache()  # transformers' prefill activations
    backend = make_backend(model, args, _ints(args.batches) + _ints(args.prefill_batches))
    # in the order given: a process's first compiled way measures faster than the ways after it,
    # with the profiler's CUPTI detached too (docs/perf-log.md), so a comparison is run in both orders
    for way in (w for w in args.ways if w != "hf_eager"):
        measure_way(backend, way, args, results)
        if args.out:  # the ways measured so far, kept should a later way not finish
            write_json(args.out, {**summarize(results, model.config, args), "finished": False})
    return summarize(results, model.config, args)


def write_json(path: str, res: dict) -> None:
    with open(path, "w") as f:
        json.dump(res, f, indent=1)


def _step_graphs(backend, **kwargs):
    return compile_step(backend, mode="reduce-overhead", cuda_graphs="step", **kwargs)


def _with_passes(passes: Callable[[], list], **kwargs) -> Callable:
    return lambda backend: compile_step(backend, mode="reduce-overhead", passes=DSV4PassManager(passes()), **kwargs)


def _entered(*settings) -> ExitStack:
    """One context that enters every one of ``settings``."""
    stack = ExitStack()
    for setting in settings:
        stack.enter_context(setting)
    return stack


# way -> (the setting its step is compiled and measured in, or None; backend -> the step)
STEP_WAYS: dict[str, tuple[Callable | None, Callable]] = {
    "compiled_lean": (None, lambda b: compile_step(b, mode="reduce-overhead", model_guards=False)),
    "compiled_step_graphs": (None, _step_graphs),
    "compiled_step_graphs_pdl": (None, lambda b: _step_graphs(b, options={"triton.enable_pdl": True})),
    "compiled_step_graphs_combo": (None, lambda b: _step_graphs(b, options={"combo_kernels": True})),
    # each step's graph captures hc_post, then hc_pre
    "compiled_step_graphs_hc_post_apart": (lambda: posted_max_tokens(0), _step_graphs),
    "compiled_step_graphs_all_lone_linears": (None, _with_passes(_linears_pass(lone_min_k=1), cuda_graphs="step")),
    "compiled_step_graphs_q_norm_folded":
        (None, _with_passes(_linears_pass(fold_input_norm=True), cuda_graphs="step")),
    "compiled_step_graphs_collapse_linears":
        (None, _with_passes(lambda: [*default_passes(), FuseCollapseLinearsPass()], cuda_graphs="step")),
    "compiled_step_graphs_collapse_q_norm_folded":
        (None, _with_passes(lambda: [*_linears_pass(fold_input_norm=True)(), FuseCollapseLinearsPass()],
                            cuda_graphs="step")),
    "compiled_step_graphs_q_norm_folded_no_prefetch":
        (lambda: weight_prefetch(False), _with_passes(_linears_pass(fold_input_norm=True), cuda_graphs="step")),
    "compiled_step_graphs_router_topk":
        (None, _with_passes(lambda: [*default_passes(), ReplaceShortTopkPass()], cuda_graphs="step")),
    "compiled_step_graphs_no_prefetch": (lambda: weight_prefetch(False), _step_graphs),
    "compiled_step_graphs_experts_no_prefetch": (lambda: expert_weight_prefetch(False), _step_graphs),
    "compiled_step_graphs_no_split_k": (lambda: linears_split_k(0), _step_graphs),
    "compiled_step_graphs_moe_apart": (lambda: moe_in_op(False), _step_graphs),
    "compiled_step_graphs_hash_router_apart": (lambda: hash_router_in_op(False), _step_graphs),
    "compiled_step_graphs_weights_then_sum": (lambda: normalise_after_sum(False), _step_graphs),
    "compiled_step_graphs_router_gate": (lambda: learned_router_op(False), _step_graphs),
    "compiled_step_graphs_switches_off": (lambda: _entered(normalise_after_sum(False), learned_router_op(False)),
                                          _step_graphs),
    "compiled_step_graphs_norm_apart": (lambda: norm_in_hc_op(False), _step_graphs),
    "compiled_step_graphs_entry_store_apart": (None, _with_passes(_without(FuseEntryStorePass), cuda_graphs="step")),
    "compiled_step_graphs_rotation_apart":
        (None, _with_passes(_without(FuseAttentionInverseRopePass), cuda_graphs="step")),
    "compiled_step_graphs_side_stream":
        (None, _with_passes(lambda: [*default_passes(), OverlapCacheWritesPass()], cuda_graphs="step")),
    **{way: (None, _with_passes(variant)) for way, variant in PASS_VARIANTS.items()},
}
WAYS = ("hf_eager", "backend_eager", "compiled", "compiled_grouped", *STEP_WAYS)
DEFAULT_WAYS = WAYS[:3]


def measure_way(backend: ModelBackend, way: str, args, results: dict) -> None:
    """Decode (and prefill) of ``backend`` the way ``way`` runs it, into ``results``."""
    if way == "backend_eager":
        measure_backend(backend, way, backend, args, results)
    elif way == "compiled":
        counters.clear()
        measure_backend(backend, way, compile_step(backend, mode="reduce-overhead"), args, results)
        results["compiled_counters"] = {"frames": counters["stats"]["unique_graphs"],
                                        "graph_breaks": sum(counters["graph_break"].values()),
                                        "cudagraph_skips": counters["inductor"]["cudagraph_skips"]}
        print("compiled:", results["compiled_counters"], flush=True)
    elif way == "compiled_grouped":
        own = backend.model.config._experts_implementation
        backend.model.set_experts_implementation("grouped_mm")
        measure_backend(backend, way, compile_step(backend, mode="reduce-overhead"), args, results)
        backend.model.set_experts_implementation(own)
    else:
        setting, build = STEP_WAYS[way]
        with setting() if setting else nullcontext():
            measure_backend(backend, way, build(backend), args, results)


def summarize(results: dict, config: DeepseekV4Config, args) -> dict:
    """Rows of tokens/s, bandwidth, floors and compiled-vs-others ratios from the raw times."""
    parts, bps = results["weights"], args.hbm_tbps * 1e12
    floor_us = 1e6 * parts["total"] / bps
    prefill, decode = [], []
    for b, times in results["prefill"].items():
        row = {"batch": b, "tokens": b * args.prompt_len, **{f"{w}_ms": t for w, t in times.items()}}
        row.update({f"{w}_tok_s": 1e3 * b * args.prompt_len / t for w, t in times.items() if t})
        prefill.append({**row, **compiled_ratios(times)})
    for b, times in results["decode"].items():
        read = decode_read_bytes(parts, config, b)
        row = {"batch": b, **{f"{w}_us": t for w, t in times.items()}, "floor_us": floor_us,
               "floor_read_us": 1e6 * read / bps}
        row.update({f"{w}_tok_s": 1e6 * b / t for w, t in times.items() if t})
        row.update({f"{w}_hbm_tbps": read / t / 1e6 for w, t in times.items() if t})
        decode.append({**row, **compiled_ratios(times)})
    return {**header(args.device, args), "weights": parts, "compile": results["compile"],
            "hf_experts_implementation": results.get("hf_experts_implementation"),
            "compiled_counters": results.get("compiled_counters"), "profile": results.get("profile"),
            "host": results.get("host"),
            "prefill": prefill, "decode": decode}


def print_tables(res: dict) -> None:
    ways = [w for w in WAYS if any(f"{w}_us" in r for r in res["decode"])]
    print(f"\n{res['device']}, torch {res['torch']}, transformers {res['transformers']}, "
          f"parameters {res['weights']['total'] / 2**30:.2f} GiB")
    print("decode  b | " + " | ".join(f"{w} us (tok/s)" for w in ways) + " | floor us (read) | compiled TB/s | "
          + " | ".join(f"compiled vs {w}" for w in ways if w != "compiled"))
    for r in res["decode"]:
        cells = [_cell(r.get(f"{w}_us"), r.get(f"{w}_tok_s")) for w in ways]
        print(f"{r['batch']:>9} | " + " | ".join(cells) + f" | {r['floor_us']:.0f} ({r['floor_read_us']:.0f}) | "
              + _num(r.get("compiled_hbm_tbps"), ".2f") + " | "
              + " | ".join(_num(r.get(f"compiled_vs_{w}"), ".1f", "x") for w in ways if w != "compiled"))
    print("prefill b | " + " | ".join(f"{w} ms (tok/s)" for w in ways))
    for r in res["prefill"]:
        print(f"{r['batch']:>9} | " + " | ".join(_cell(r.get(f"{w}_ms"), r.get(f"{w}_tok_s")) for w in ways))
    if res["compile"]:
        print("compile s (first calls): cold " + json.dumps(res["compile"]["cold"])
              + ", warm " + json.dumps(res["compile"]["warm"]))


def _cell(t: float | None, rate: float | None) -> str:
    return "—" if t is None else f"{t:.1f} ({rate:.0f})"


def _num(v: float | None, fmt: str, suffix: str = "") -> str:
    return "—" if v is None else f"{v:{fmt}}{suffix}"


def plot(res: dict, png: str) -> None:
    """Decode and prefill tokens/s per way against the batch size; decode with the weight floors."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    panels = [("decode", res["decode"])] + ([("prefill", res["prefill"])] if res["prefill"] else [])
    fig, axes = plt.subplots(1, len(panels), figsize=(6 * len(panels), 4.5), squeeze=False)
    axes = dict(zip((kind for kind, _ in panels), axes[0]))
    for way in WAYS:
        for kind, rows in panels:
            pts = [(r["batch"], r[f"{way}_tok_s"]) for r in rows if r.get(f"{way}_tok_s")]
            if pts:
                axes[kind].plot(*zip(*pts), marker="o", label=way)
    dec = axes["decode"]
    for key, style, label in (("floor_us", "k--", "floor (all weights)"),
                              ("floor_read_us", "k:", "floor (weights read)")):
        # a marker too, so that a floor of one batch size shows
        dec.plot([r["batch"] for r in res["decode"]], [1e6 * r["batch"] / r[key] for r in res["decode"]], style,
                 marker="_", markersize=16, label=label)
    dec.set(xscale="log", yscale="log", xlabel="batch (requests)", ylabel="decode tokens/s",
            title=f"decode, prompt {res['args']['prompt_len']}")
    if "prefill" in axes:
        axes["prefill"].set(xscale="log", yscale="log", xlabel="prompts per step", ylabel="prefill tokens/s",
                            title=f"prefill, {res['args']['prompt_len']}-token prompts")
    for ax in axes.values():
        ax.legend(fontsize=8)
    fig.suptitle(f"DeepSeek V4 model ({res['weights']['total'] / 2**30:.1f} GiB), {res['device']}")
    fig.tight_layout()
    fig.savefig(png, dpi=120)


def main() -> None:
    args = parse_args()
    if args.replot:
        with open(args.replot) as f:
            plot(json.load(f), args.plot or args.replot.removesuffix(".json") + ".png")
        return
    if args.compile_probe:
        with torch.no_grad():
            print(PROBE_TAG + json.dumps(compile_probe(args)), flush=True)
        return
    start = time.perf_counter()
    res = {**header(args.device, args), "compile": compile_times(args)} if args.compile_time_only else run(args)
    res["run_s"], res["finished"] = time.perf_counter() - start, True
    if not args.compile_time_only:
        print_tables(res)
    print(f"whole run: {res['run_s']:.0f} s")
    if args.out:
        write_json(args.out, res)
    if args.plot and not args.compile_time_only:
        plot(res, args.plot)


if __name__ == "__main__":
    main()
