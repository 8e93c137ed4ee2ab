"""The runner's own host time per step: building a decode step, and a whole generate loop around a
step that costs nothing (or a given GPU time).

Usage:
    python benchmarks/bench_runner_host.py --device cpu --out runner_host.json
    python benchmarks/bench_runner_host.py --device cuda --batch 1 8 64 --out runner_host.json
    python benchmarks/bench_runner_host.py --device cuda --batch 1 8 64 --device-step-us 1200 --out runner_overlap.json

On the cache of the CLI's built-in model (``python -m dsv4_compile``; weights drawn at random), with
``--batch`` requests holding a ``--prompt-len`` prompt each:

    build_step  ``ModelRunner.build_step`` of one decode token per request (page allocation, the
                index-map writes, the step's tensors): median µs per call over ``--repeats`` runs of
                ``--steps`` calls
    generate    ``ModelRunner.generate(prompts, --steps)`` with a step function that returns zero
                logits at once: µs per step of everything the runner does between steps (planning,
                building, the logit rows, the greedy pick, bookkeeping), prefill steps included;
                the runner builds each step while the device runs the one before it (as it does
                by default on a GPU)
    generate_serial  the same with ``build_ahead=False``: each step built after the last one's
                tokens are read

On a GPU every figure includes the waits of the host on the device that the runner's transfers
cause. The step function launches nothing, unless ``--device-step-us`` gives it a GPU sleep of that
many µs (a model step's device time, e.g. 1,200 µs for the b = 1 model step on an H100): then
``generate`` shows how much of the host's work hides behind the device's step, and
``generate_serial`` the two added up.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable

import torch

from dsv4_compile.evaluate.inputs import builtin_config
from dsv4_compile.model import enable
from dsv4_compile.runner import ModelRunner
from dsv4_compile.step import ForwardMode
from dsv4_compile.testing.bench import header
from dsv4_compile.testing.random_model import random_hf_model


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--batch", type=int, nargs="+", default=[1, 8, 64], help="requests per step")
    p.add_argument("--prompt-len", type=int, default=100)
    p.add_argument("--steps", type=int, default=200, help="decode steps per timed run")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--device-step-us", type=float, default=0.0,
                   help="GPU time of each step (a calibrated sleep; CUDA only), 0: none")
    p.add_argument("--out", help="write the results as JSON")
    return p.parse_args(argv)


def device_step(us: float, device: torch.device) -> Callable[[], None]:
    """A call that queues about ``us`` µs of GPU work (``torch.cuda._sleep``, its cycles per µs
    measured once) and returns at once; nothing for ``us == 0``."""
    if not us:
        return lambda: None
    if device.type != "cuda":
        raise SystemExit("--device-step-us needs --device cuda")
    cycles = 10_000_000
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda._sleep(cycles)
    start.record()
    torch.cuda._sleep(cycles)
    end.record()
    end.synchronize()
    sleep = int(us * cycles / (start.elapsed_time(end) * 1e3))
    return lambda: torch.cuda._sleep(sleep)


def _median_us(fn, calls: int, repeats: int) -> float:
    """Median over ``repeats`` of the µs per call of ``calls`` calls of ``fn``."""
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        times.append((time.perf_counter() - start) / calls * 1e6)
    return statistics.median(times)


def build_step_us(runner: ModelRunner, batch: int, args) -> float:
    rows = [runner.admit() for _ in range(batch)]
    try:
        runner.build_step(ForwardMode.EXTEND, {r: args.prompt_len for r in rows})
        return _median_us(lambda: runner.build_step(ForwardMode.EXTEND, {r: 1 for r in rows}), args.steps,
                          args.repeats)
    finally:
        for r in rows:
            runner.release(r)


def generate_us(runner: ModelRunner, batch: int, args) -> float:
    prompts = [[1] * args.prompt_len for _ in range(batch)]
    runner.generate(prompts, 2)  # warm-up
    return _median_us(lambda: runner.generate(prompts, args.steps), 1, args.repeats) / args.steps


def generate_serial_us(runner: ModelRunner, batch: int, args) -> float:
    runner.build_ahead = False
    try:
        return generate_us(runner, batch, args)
    finally:
        runner.build_ahead = True


def main(argv=None) -> None:
    args = parse_args(argv)
    torch.set_grad_enabled(False)
    length = args.prompt_len + args.steps * (args.repeats + 1) + 1
    backend = enable(random_hf_model(builtin_config(), device=args.device), max_requests=max(args.batch),
                     max_seq_len=-(-length // 256) * 256)
    vocab = backend.vocab_size
    on_device = device_step(args.device_step_us, torch.device(args.device))

    def no_step(ids, step, logit_rows):
        on_device()
        return torch.zeros(logit_rows.shape[0], vocab, device=ids.device)

    runner = ModelRunner(backend, step_fn=no_step, build_ahead=True)
    results = []
    for b in args.batch:
        row = {"batch": b, "build_step_us": build_step_us(runner, b, args), "generate_us": generate_us(runner, b, args),
               "generate_serial_us": generate_serial_us(runner, b, args)}
        print(f"b {b:>3}: build_step {row['build_step_us']:.0f} us, generate {row['generate_us']:.0f} us a step "
              f"({row['generate_serial_us']:.0f} building each step after the last one's tokens)", flush=True)
        results.append(row)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({**header(args.device, args), "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
