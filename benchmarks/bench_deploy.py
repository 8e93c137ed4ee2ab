"""Ahead-of-time packages against the backend eager and compiled: build time, load time, step latency.

Usage:
    python benchmarks/bench_deploy.py --out benchmarks/results/bench_deploy_<date>.json   # CPU
    CXX=/usr/bin/g++ python benchmarks/bench_deploy.py --device cuda --out ...            # GPU

The model: the built-in model of ``python -m dsv4_compile`` (``dsv4_compile/evaluate/default_model.json``,
every attention layer type), on ``--device``, with a cache of ``--max-requests`` requests of
``--max-seq-len`` positions. On a GPU, build with a ``CXX`` that links libstdc++ dynamically
(docs/deploy.md, "Loading on a GPU"). Measured in one process:

    build      ``export.package`` of the ``extend`` and ``decode`` programs (export + AOTInductor), wall s
    load       ``deploy.load`` of the package (both programs), wall s
    steps      median wall time of a decode step of b requests (``--batches``) at ``--context``
               positions each, and of one prefill step of ``--prefill`` tokens, for three ways:
               ``eager`` (the backend's eager step), ``compiled`` (``compile_step`` as
               ``python -m dsv4_compile`` compiles on the device: on a CPU Dynamo's graph on the
               eager backend, on a GPU Inductor with CUDA graphs; its first call, compilation
               included, is reported apart) and ``package``. GPU times end with a synchronize.

Every way runs the same steps on a cache of its own filled with the same prompts; their logits
are compared (max |Δ| against eager: the package agrees to a bf16 rounding step, docs/deploy.md "Numerics").
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch

from dsv4_compile import deploy, export
from dsv4_compile.compile import compile_step
from dsv4_compile.evaluate.inputs import builtin_model
from dsv4_compile.evaluate.run import COMPILED
from dsv4_compile.model import enable
from dsv4_compile.step import ForwardMode, StepInputs
from dsv4_compile.testing.bench import header, wall_call

WAYS = ("eager", "compiled", "package")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--max-requests", type=int, default=4)
    p.add_argument("--max-seq-len", type=int, default=1024)
    p.add_argument("--batches", default="1,4", help="decode batch sizes")
    p.add_argument("--context", type=int, default=512, help="positions of each request before decoding")
    p.add_argument("--prefill", type=int, default=256, help="tokens of the prefill step")
    p.add_argument("--iters", type=int, default=10, help="timed steps per case")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="cpu")
    p.add_argument("--out", help="write the results as JSON")
    return p.parse_args(argv)


def fill(model, batch: int, context: int, seed: int) -> list[int]:
    """``batch`` requests of ``context`` random tokens prefilled into ``model``'s cache: their rows."""
    gen, device = torch.Generator().manual_seed(seed), model.cache.device
    rows = [model.allocator.admit() for _ in range(batch)]
    for row in rows:
        for start in range(0, context, 256):
            n = min(256, context - start)
            step = _step(model, ForwardMode.EXTEND, [row], n)
            model(torch.randint(0, model.vocab_size, (n,), generator=gen).to(device), step,
                  torch.tensor([n - 1], device=device))
    return rows


def _step(model, mode: ForwardMode, rows: list[int], per_row: int) -> StepInputs:
    loc = torch.cat([model.allocator.extend(row, per_row) for row in rows])
    return StepInputs.make(mode, rows, [model.allocator.seq_len(r) for r in rows], [per_row] * len(rows), loc,
                           device=model.cache.device)


def time_steps(model, step_fn, mode: ForwardMode, rows: list[int] | None, per_row: int, iters: int
               ) -> tuple[list[float], torch.Tensor]:
    """Wall time (ms) of ``iters`` steps of ``per_row`` tokens for each of ``rows`` (inputs built
    before the clock starts), and a copy of the last logits (a CUDA-graph replay reuses its output).
    ``rows=None``: each step is a new request's first ``per_row`` tokens (freed after its step)."""
    times, logits, device = [], None, model.cache.device
    for _ in range(iters):
        step_rows = rows if rows is not None else [model.allocator.admit()]
        step = _step(model, mode, step_rows, per_row)
        ids = torch.zeros(step.num_tokens, dtype=torch.int64, device=device)
        logit_rows = torch.arange(max(2, len(step_rows)), device=device) % step.num_tokens
        logits, seconds = wall_call(lambda: step_fn(ids, step, logit_rows), device)
        times.append(1e3 * seconds)
        if rows is None:
            model.allocator.free(step_rows[0])
    return times, logits.clone()


def measure(model, step_fn, args) -> dict:
    """Decode and prefill step times of one way, on ``model``'s cache (emptied afterwards)."""
    out = {}
    for b in map(int, args.batches.split(",")):
        rows = fill(model, b, args.context, args.seed)
        times, logits = time_steps(model, step_fn, ForwardMode.DECODE, rows, 1, args.iters + 1)
        out[f"decode_b{b}"] = {"first_ms": times[0], "median_ms": statistics.median(times[1:]), "logits": logits}
        for row in rows:
            model.allocator.free(row)
    times, logits = time_steps(model, step_fn, ForwardMode.EXTEND, None, args.prefill, 1 + max(1, args.iters // 3))
    out[f"prefill_{args.prefill}"] = {"first_ms": times[0], "median_ms": statistics.median(times[1:]), "logits": logits}
    return out


def check_args(args) -> None:
    """Refuse sizes the cache cannot hold before anything is built."""
    batches = list(map(int, args.batches.split(",")))
    if max(batches) > args.max_requests:
        raise SystemExit(f"--batches: {max(batches)} requests, the cache holds --max-requests {args.max_requests}")
    if args.context + args.iters + 1 > args.max_seq_len or args.prefill > args.max_seq_len:
        raise SystemExit(f"--context {args.context} + --iters {args.iters} + 1 decode positions and --prefill "
                         f"{args.prefill} must fit --max-seq-len {args.max_seq_len}")


def main(argv=None) -> dict:
    args = parse_args(argv)
    check_args(args)
    device = torch.device(args.device)
    backend = enable(builtin_model(device, args.seed), max_requests=args.max_requests,
                     max_seq_len=args.max_seq_len)
    results = {**header(device.type, args), "ways": {}}
    with tempfile.TemporaryDirectory() as tmp, torch.no_grad():
        start = time.perf_counter()
        path = export.package(backend, Path(tmp) / "model.pt2")
        results["build_s"], results["package_mib"] = time.perf_counter() - start, Path(path).stat().st_size / 2**20
        print(f"built in {results['build_s']:.0f} s", flush=True)
        start = time.perf_counter()
        deployed = deploy.load(path)
        results["load_s"] = time.perf_counter() - start
        compiled = compile_step(backend, backend=COMPILED[device.type][0])
        # the package before the compiled way, whose first call compiles for minutes on a GPU
        ways = {"eager": (backend, backend), "package": (deployed, deployed), "compiled": (backend, compiled)}
        for name, (model, step_fn) in ways.items():
            results["ways"][name] = measure(model, step_fn, args)
            print(name, {case: round(r["median_ms"], 2) for case, r in results["ways"][name].items()}, flush=True)
    _report(results)
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=1, default=_plain))
    return results


def _report(results: dict) -> None:
    eager = results["ways"]["eager"]
    print(f"package: built in {results['build_s']:.0f} s, {results['package_mib']:.1f} MiB, "
          f"loaded in {results['load_s']:.2f} s")
    print("case          | " + " | ".join(f"{w} ms (first)" for w in WAYS) + " | package max |Δ logit| vs eager")
    for case in eager:
        cells = [f"{results['ways'][w][case]['median_ms']:8.1f} ({results['ways'][w][case]['first_ms']:.0f})"
                 for w in WAYS]
        diff = (results["ways"]["package"][case]["logits"].float() - eager[case]["logits"].float()).abs().max()
        print(f"{case:<13} | " + " | ".join(cells) + f" | {diff.item():.3g}")


def _plain(value):
    """JSON form of the logits tensors kept for the comparison: left out."""
    return None if isinstance(value, torch.Tensor) else str(value)


if __name__ == "__main__":
    main()
