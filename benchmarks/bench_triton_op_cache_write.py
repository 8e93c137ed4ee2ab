"""Whether a cache write through ``torch.library.triton_op`` copies the cache on every call, under
``torch.compile`` and inside an AOTInductor package: µs per call at two cache sizes.

Usage:
    CXX=/usr/bin/g++ python benchmarks/bench_triton_op_cache_write.py --out benchmarks/results/bench_triton_op_cache_write_<date>.json

The step: a ``triton_op`` (``bench::write_rows``, ``mutates_args={"cache"}``) whose Triton kernel
writes two bf16 rows of 512 into a ``[rows, 512]`` cache at given slots, then a small reduction of
the rows (so the program has an output). The cache is an input of the compiled function and of the
exported program, as the model step's cache buffers are (docs/deploy.md). For each ``--sizes-mib``
the step is compiled, exported and packaged; each way is timed (wall time of ``--iters`` calls
after warm-up, synchronized) and checked to have written the rows into the caller's cache. A call
whose time grows with the cache size copies the cache: the trap to avoid before Triton kernels go
inside packages as ``triton_op``s.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import torch
import triton
import triton.language as tl
from torch.library import triton_op, wrap_triton

from dsv4_compile.testing.bench import header

ROW = 512


@triton.jit
def _write_rows_kernel(cache_ptr, slots_ptr, rows_ptr, D: tl.constexpr):
    i = tl.program_id(0)
    slot = tl.load(slots_ptr + i).to(tl.int64)
    d = tl.arange(0, D)
    tl.store(cache_ptr + slot * D + d, tl.load(rows_ptr + i * D + d))


@triton_op("bench::write_rows", mutates_args={"cache"})
def write_rows(cache: torch.Tensor, slots: torch.Tensor, rows: torch.Tensor) -> None:
    wrap_triton(_write_rows_kernel)[(slots.shape[0],)](cache, slots, rows, D=rows.shape[1])


class Step(torch.nn.Module):
    def forward(self, cache: torch.Tensor, slots: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        torch.ops.bench.write_rows(cache, slots, rows)
        return rows.float().sum(dim=1)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes-mib", default="64,1024", help="cache sizes, MiB")
    p.add_argument("--iters", type=int, default=50)
    p.add_argument("--out")
    return p.parse_args(argv)


def per_call_us(fn, args: tuple, iters: int) -> float:
    for _ in range(3):
        fn(*args)
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(iters):
        fn(*args)
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / iters * 1e6


def writes_land(fn, cache: torch.Tensor, slots: torch.Tensor, rows: torch.Tensor) -> bool:
    cache.zero_()
    fn(cache, slots, rows)
    return torch.equal(cache[slots], rows)


def measure(mib: int, iters: int) -> dict:
    count = mib * 2**20 // (ROW * 2)
    cache = torch.zeros(count, ROW, dtype=torch.bfloat16, device="cuda")
    slots = torch.tensor([3, count - 1], device="cuda")
    rows = torch.randn(2, ROW, device="cuda").bfloat16()
    step = Step()
    compiled = torch.compile(step, fullgraph=True)
    path = Path(tempfile.mkdtemp()) / "step.pt2"
    start = time.perf_counter()
    torch._inductor.aoti_compile_and_package(torch.export.export(step, (cache, slots, rows)), package_path=str(path))
    build_s = time.perf_counter() - start
    package = torch._inductor.aoti_load_package(str(path))
    args = (cache, slots, rows)
    return {"cache_mib": mib, "package_build_s": build_s,
            "compiled_us": per_call_us(compiled, args, iters), "compiled_writes": writes_land(compiled, *args),
            "package_us": per_call_us(package, args, iters), "package_writes": writes_land(package, *args)}


def main(argv=None) -> dict:
    args = parse_args(argv)
    results = {**header("cuda", args), "triton": triton.__version__, "cases": []}
    for mib in map(int, args.sizes_mib.split(",")):
        case = measure(mib, args.iters)
        results["cases"].append(case)
        print(f"cache {mib:6d} MiB | compiled {case['compiled_us']:8.1f} us (writes {case['compiled_writes']}) | "
              f"package {case['package_us']:8.1f} us (writes {case['package_writes']})", flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=1))
    return results


if __name__ == "__main__":
    main()
