"""Demo: a small DSV4 attention stack served step by step, every step checked against the oracle.

Usage:
    python -m dsv4_compile                      # tiny preset on CPU, eager reference ops
    python -m dsv4_compile --device cuda        # on a GPU (Triton kernels where registered)
    python -m dsv4_compile --compile            # the step through compile_step: one graph, the
                                                # dsv4 FX passes, CUDA graphs on a GPU

A few requests are admitted, prefilled (the last one in two chunks), then decoded together with
the page allocator running between steps (padded to bucket sizes when compiled). Hidden states
are seeded random rows; each step's outputs are compared with the cache-free dense oracle
(docs/semantics.md §4.7) through :class:`~dsv4_compile.testing.oracle_recorder.OracleRecorder`.
The summary reports steps, tokens/s of the steps themselves (compilation is timed and reported
separately) and the worst relative error. Bad arguments, and a preset whose weights and cache do
not fit in the memory the device has available, end in one error line before anything is
allocated.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch

from .cache import DSV4Cache
from .compile import compile_step
from .config import PAGE_SIZE, DSV4AttnConfig
from .layer import DSV4AttentionStack
from .step import ForwardMode
from .testing.oracle_recorder import STACK_RTOL, make_engine

PROG = "python -m dsv4_compile"


class ArgumentError(Exception):
    """A bad command line: reported as one line, exit status 2."""


def _progress(i: int, n: int, label: str) -> None:
    if not sys.stderr.isatty() and i not in (0, n):
        return
    width = 30
    filled = width * i // max(n, 1)
    sys.stderr.write(f"\r[{'#' * filled}{'.' * (width - filled)}] {i}/{n} {label}   ")
    if i == n:
        sys.stderr.write("\n")
    sys.stderr.flush()


class CompileClock:
    """Times compilation through Dynamo's compile callbacks (graph compiles and CUDA-graph
    recordings) and says on stderr when one starts, so a cold compile is not mistaken for a hang."""

    def __init__(self):
        self.seconds, self.counts, self._start = 0.0, {}, 0.0

    @staticmethod
    def _what(args) -> str:
        trigger = getattr(args[0], "callback_trigger", None) if args else None
        return "CUDA-graph recording" if getattr(trigger, "name", "") == "CUDAGRAPH_RECORDING" else "compilation"

    def _on_start(self, *args) -> None:
        self._start = time.perf_counter()
        if self._what(args) == "compilation":
            sys.stderr.write("\ncompiling the step (a cold compile can take minutes on CPU) ...\n")
            sys.stderr.flush()

    def _on_end(self, *args) -> None:
        elapsed = time.perf_counter() - self._start
        what = self._what(args)
        self.seconds += elapsed
        self.counts[what] = self.counts.get(what, 0) + 1
        if what == "compilation":
            sys.stderr.write(f"compiled in {elapsed:.1f} s\n")
            sys.stderr.flush()

    def summary(self) -> str:
        done = ", ".join(f"{n} {what}{'s' if n > 1 else ''}" for what, n in self.counts.items()) or "nothing"
        return f"{done} in {self.seconds:.1f} s"

    def __enter__(self) -> "CompileClock":
        torch._dynamo.callback_handler.register_start_callback(self._on_start)
        torch._dynamo.callback_handler.register_end_callback(self._on_end)
        return self

    def __exit__(self, *exc) -> None:
        torch._dynamo.callback_handler.remove_start_callback(self._on_start)
        torch._dynamo.callback_handler.remove_end_callback(self._on_end)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog=PROG, description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", default="tiny", help="config preset: tiny, flash, pro")
    p.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N")
    p.add_argument("--requests", type=int, default=3)
    p.add_argument("--prefill", type=int, default=272, help="prompt tokens per request")
    p.add_argument("--decode-steps", type=int, default=16)
    p.add_argument("--index-topk", type=int, default=64,
                   help="indexer top-k (64 lets a short demo exceed it; the model uses 512/1024)")
    p.add_argument("--compile", action="store_true",
                   help="run the step through compile_step (one graph, dsv4 passes, CUDA graphs on a GPU)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-check", action="store_true", help="skip the oracle comparison")
    return p.parse_args(argv)


def check_device(name: str) -> torch.device:
    """``name`` as a usable device (``cpu``, ``cuda``, ``cuda:N``), else :class:`ArgumentError`."""
    try:
        device = torch.device(name)
    except RuntimeError:
        raise ArgumentError(f"--device {name!r} is not a device name; use cpu, cuda or cuda:N") from None
    if device.type == "cpu":
        return device
    if device.type != "cuda":
        raise ArgumentError(f"--device {name!r}: only cpu and cuda are supported")
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if not count:
        raise ArgumentError(f"--device {name!r}: no CUDA device is available")
    if (device.index or 0) >= count:
        raise ArgumentError(f"--device {name!r}: this machine has {count} CUDA device(s)")
    return device


def required_bytes(config: DSV4AttnConfig, max_requests: int, max_seq_len: int) -> tuple[int, int]:
    """``(weights, cache)`` bytes of a stack and its cache, counted on the meta device (nothing
    is allocated)."""
    with torch.device("meta"):
        cache = DSV4Cache(config, max_requests=max_requests, max_seq_len=max_seq_len)
        stack = DSV4AttentionStack(config, cache)
    weights = sum(t.numel() * t.element_size() for t in stack.parameters())
    weights += sum(t.numel() * t.element_size() for n, t in stack.named_buffers() if not n.startswith("cache."))
    return weights, cache.nbytes()


def available_bytes(device: torch.device) -> int:
    """Memory available for new tensors: free GPU memory, or the host's MemAvailable."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    try:
        with open("/proc/meminfo") as f:
            fields = dict(line.split(":", 1) for line in f)
        return int(fields["MemAvailable"].split()[0]) * 1024
    except (OSError, KeyError, ValueError):
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def check_memory(preset: str, config: DSV4AttnConfig, device: torch.device, max_requests: int,
                 max_seq_len: int) -> None:
    """:class:`ArgumentError` unless the weights (initialised on the host) and weights + cache (on
    ``device``) fit in the memory available."""
    weights, cache = required_bytes(config, max_requests, max_seq_len)
    needs = [(torch.device("cpu"), weights), (device, weights + cache)]
    for where, need in needs[1:] if device.type == "cpu" else needs:
        have = available_bytes(where)
        if need > have:
            gib = 2 ** 30
            raise ArgumentError(f"--preset {preset} needs {need / gib:.1f} GiB on {where} (weights "
                                f"{weights / gib:.1f} GiB + cache {cache / gib:.2f} GiB for {max_requests} "
                                f"requests of {max_seq_len} tokens) but {have / gib:.1f} GiB is available")


def _setup(args: argparse.Namespace):
    """``(config, engine, recorder)`` after every argument and memory check."""
    try:
        config = DSV4AttnConfig.from_name(args.preset)
    except ValueError as e:
        raise ArgumentError(f"--preset: {e}") from None
    try:
        config = config.with_(index_topk=args.index_topk)
    except ValueError as e:
        raise ArgumentError(f"--index-topk: {e}") from None
    for name in ("requests", "prefill", "decode_steps"):
        if getattr(args, name) < 1:
            raise ArgumentError(f"--{name.replace('_', '-')} must be >= 1")
    device = check_device(args.device)
    max_seq = -(-(args.prefill + args.decode_steps) // PAGE_SIZE) * PAGE_SIZE
    check_memory(args.preset, config, device, args.requests, max_seq)
    engine, recorder = make_engine(config, max_requests=args.requests, max_seq_len=max_seq, seed=args.seed,
                                   device=device, capture_layers=False)
    if args.compile:
        engine.forward = compile_step(engine.stack)
        engine.bucketed = True
    return config, engine, recorder


def _plan(args: argparse.Namespace, rows: list[int]) -> list[tuple[ForwardMode, dict[int, int]]]:
    first = args.prefill // 2
    plan = [(ForwardMode.EXTEND, {r: args.prefill if r != rows[-1] else first for r in rows}),
            (ForwardMode.EXTEND, {rows[-1]: args.prefill - first})]
    return plan + [(ForwardMode.DECODE, {r: 1 for r in rows})] * args.decode_steps


def _serve(args, engine, recorder) -> tuple[int, float, float, CompileClock]:
    """Run the plan; returns tokens, seconds spent in steps (compilation excluded), the worst
    error against the oracle and the compile clock."""
    plan = _plan(args, [engine.admit() for _ in range(args.requests)])
    worst, tokens, seconds = 0.0, 0, 0.0
    with torch.no_grad(), CompileClock() as clock:
        for i, (mode, tokens_per_row) in enumerate(plan):
            _progress(i, len(plan), mode.value)
            start, compiling = time.perf_counter(), clock.seconds
            out = recorder.run(mode, tokens_per_row)
            if engine.device.type == "cuda":
                torch.cuda.synchronize()
            seconds += time.perf_counter() - start - (clock.seconds - compiling)
            tokens += sum(tokens_per_row.values())
            if not args.no_check:
                worst = max(worst, recorder.output_error(out))
        _progress(len(plan), len(plan), "done")
    return tokens, seconds, worst, clock


def main(argv=None) -> int:
    args = parse_args(argv)
    try:
        config, engine, recorder = _setup(args)
    except ArgumentError as e:
        print(f"{PROG}: error: {e}", file=sys.stderr)
        return 2
    print(f"dsv4-compile demo: preset={args.preset} layers={config.compress_ratios} heads={config.num_heads} "
          f"device={engine.device} compile={args.compile} cache={engine.stack.cache.nbytes() / 2**20:.1f} MiB")
    tokens, seconds, worst, clock = _serve(args, engine, recorder)
    steps = args.decode_steps + 2
    print(f"steps: {steps} (2 prefill, {args.decode_steps} decode)  tokens: {tokens}  "
          f"tokens/s: {tokens / seconds:.1f}" + (" (compilation excluded)" if args.compile else ""))
    if args.compile:
        print(f"compile: {clock.summary()}")
    if args.no_check:
        return 0
    ok = worst <= STACK_RTOL
    print(f"max relative error vs oracle: {worst:.4f} ({'OK' if ok else 'FAIL'}, bound {STACK_RTOL})")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
