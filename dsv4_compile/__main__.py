"""Demo: a small DSV4 attention stack served step by step, every step checked against the oracle.

Usage:
    python -m dsv4_compile                      # tiny preset on CPU, eager reference ops
    python -m dsv4_compile --device cuda        # on a GPU (Triton kernels where registered)
    python -m dsv4_compile --compile            # the step under torch.compile(fullgraph=True)

A few requests are admitted, prefilled (the last one in two chunks), then decoded together with
the page allocator running between steps. Hidden states are seeded random rows; each step's
outputs are compared with the cache-free dense oracle (docs/semantics.md §4.7) through
:class:`~dsv4_compile.testing.oracle_recorder.OracleRecorder`. The summary reports steps, tokens/s
and the worst relative error.
"""

from __future__ import annotations

import argparse
import sys
import time

import torch

from .config import DSV4AttnConfig
from .step import ForwardMode
from .testing.oracle_recorder import STACK_RTOL, make_engine


def _progress(i: int, n: int, label: str) -> None:
    if not sys.stderr.isatty() and i not in (0, n):
        return
    width = 30
    filled = width * i // max(n, 1)
    sys.stderr.write(f"\r[{'#' * filled}{'.' * (width - filled)}] {i}/{n} {label}   ")
    if i == n:
        sys.stderr.write("\n")
    sys.stderr.flush()


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m dsv4_compile", description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", default="tiny", help="config preset: tiny, flash, pro")
    p.add_argument("--device", default="cpu")
    p.add_argument("--requests", type=int, default=3)
    p.add_argument("--prefill", type=int, default=272, help="prompt tokens per request")
    p.add_argument("--decode-steps", type=int, default=16)
    p.add_argument("--index-topk", type=int, default=64,
                   help="indexer top-k (64 lets a short demo exceed it; the model uses 512/1024)")
    p.add_argument("--compile", action="store_true", help="run the step under torch.compile(fullgraph=True)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-check", action="store_true", help="skip the oracle comparison")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    config = DSV4AttnConfig.from_name(args.preset).with_(index_topk=args.index_topk)
    max_seq = -(-(args.prefill + args.decode_steps) // 256) * 256
    engine, recorder = make_engine(config, max_requests=args.requests, max_seq_len=max_seq, seed=args.seed,
                                   device=args.device, capture_layers=False)
    if args.compile:
        engine.forward = torch.compile(engine.stack, fullgraph=True)
    rows = [engine.admit() for _ in range(args.requests)]
    first = args.prefill // 2
    plan = [(ForwardMode.EXTEND, {r: args.prefill if r != rows[-1] else first for r in rows}),
            (ForwardMode.EXTEND, {rows[-1]: args.prefill - first})]
    plan += [(ForwardMode.DECODE, {r: 1 for r in rows})] * args.decode_steps
    print(f"dsv4-compile demo: preset={args.preset} layers={config.compress_ratios} heads={config.num_heads} "
          f"device={args.device} compile={args.compile} cache={engine.stack.cache.nbytes() / 2**20:.1f} MiB")
    worst, tokens, seconds = 0.0, 0, 0.0
    with torch.no_grad():
        for i, (mode, tokens_per_row) in enumerate(plan):
            _progress(i, len(plan), mode.value)
            start = time.perf_counter()
            out = recorder.run(mode, tokens_per_row)
            if args.device.startswith("cuda"):
                torch.cuda.synchronize()
            seconds += time.perf_counter() - start
            tokens += sum(tokens_per_row.values())
            if not args.no_check:
                worst = max(worst, recorder.output_error(out))
        _progress(len(plan), len(plan), "done")
    prefill_steps = sum(mode is ForwardMode.EXTEND for mode, _ in plan)
    print(f"steps: {len(plan)} ({prefill_steps} prefill, {args.decode_steps} decode)  tokens: {tokens}  "
          f"tokens/s: {tokens / seconds:.1f}")
    if args.no_check:
        return 0
    ok = worst <= STACK_RTOL
    print(f"max relative error vs oracle: {worst:.4f} ({'OK' if ok else 'FAIL'}, bound {STACK_RTOL})")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
