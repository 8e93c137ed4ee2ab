"""Compile time of ``compile_step``: the first call's Dynamo trace and total compile time, for
stacks of 3, 12 and 43 layers, with the eager and Inductor backends, cold and warm Inductor cache.

Usage:
    python benchmarks/bench_compile_time.py --out compile_time.json                 # CPU, tiny dims
    python benchmarks/bench_compile_time.py --layers 43 --backends inductor --pass-devices cpu  # CPU, as CUDA
    python benchmarks/bench_compile_time.py --device cuda --preset flash --out compile_time.json

Stacks: 3 layers are bench_step's stack (ratios 0, 4, 128); n layers otherwise are the first n
ratios of the ``flash`` preset (43: the whole Flash stack), with the dimensions of ``--preset``
(default ``tiny``: small hidden size and head counts, so CPU memory stays low). The cache holds two
requests of at most 512 tokens (index top-k 64 to match); the compiled call is a decode step of both.
The dsv4 passes rewrite the nodes of their default devices (CUDA) unless ``--pass-devices`` names
others: with ``cpu`` a CPU stack is rewritten as a CUDA one is, so the CPU shows how a change moves
the compile phases that do not depend on the device (Dynamo, AOTAutograd, the passes, lowering).

Each case runs in a fresh process (nothing of an earlier compile in memory): "cold" with an empty
``TORCHINDUCTOR_CACHE_DIR``, then "warm" in a second process on the same directory. Reported per
case: ``first_call_s`` (wall time of the first compiled call, device synchronised), ``second_call_s``
(the same step again: what the first call spent running rather than compiling), ``trace_s``
(Dynamo's ``bytecode_tracing``), ``backend_s`` (``OutputGraph.call_user_compiler``: AOT and
Inductor), Dynamo frames and graph breaks, the hits, misses and bypasses of Inductor's FX graph
cache and AOTAutograd's cache (``inductor_*``, ``aot_autograd_*``), and ``phases``: every timed
phase of torch's compile of at least half a second (nested phases included, so they overlap).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

import torch

from dsv4_compile import DSV4AttnConfig, DSV4AttentionStack, DSV4Cache, ForwardMode
from dsv4_compile.compile import compile_step
from dsv4_compile.engine import Engine
from dsv4_compile.fx_passes import DSV4PassManager
from dsv4_compile.fx_passes.pass_manager import default_passes

_TIMERS = {"trace_s": "bytecode_tracing", "backend_s": "OutputGraph.call_user_compiler"}
# compiled-graph caches whose hits a warm process should show: Inductor's FX graph cache and
# AOTAutograd's cache (Dynamo counter group -> counter prefix)
_CACHES = {"inductor": "fxgraph_cache", "aot_autograd": "autograd_cache"}
# every timed compile phase (torch's ``compilation_time_metrics``) of at least this many seconds,
# nested phases included, so a row says where its time went
_PHASE_MIN_S = 0.5


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--layers", default="3,12,43")
    p.add_argument("--backends", default="eager,inductor")
    p.add_argument("--preset", default="tiny", help="dimensions of the stack")
    p.add_argument("--device", default="cpu")
    p.add_argument("--pass-devices", default=None,
                   help="device types the dsv4 passes rewrite (default: theirs, cuda); 'cpu' compiles a CPU "
                        "stack rewritten as a CUDA one is")
    p.add_argument("--out", default=None, help="write results as JSON")
    p.add_argument("--case", default=None, help=argparse.SUPPRESS)  # one case, in this process
    return p.parse_args(argv)


def stack_ratios(layers: int) -> tuple[int, ...]:
    """bench_step's stack for 3 layers, else the first ``layers`` ratios of the flash preset."""
    return (0, 4, 128) if layers == 3 else DSV4AttnConfig.from_name("flash").compress_ratios[:layers]


def run_case(layers: int, backend: str, preset: str, device: str, pass_devices: str | None = None) -> dict:
    """Build the stack, compile its step and time the first two calls (this process only)."""
    config = DSV4AttnConfig.from_name(preset).with_(compress_ratios=stack_ratios(layers), index_topk=64)
    cache = DSV4Cache(config, max_requests=2, max_seq_len=512, device=device)
    engine = Engine(DSV4AttentionStack(config, cache).reset_parameters(0).to(device))
    rows = [engine.admit() for _ in range(2)]
    for row in rows:
        engine.allocator.extend(row, 20)
    step = engine.build_step(ForwardMode.DECODE, {r: 1 for r in rows})
    x = torch.randn(len(rows), config.hidden_size, device=device, dtype=torch.bfloat16)
    passes = None if backend != "inductor" else DSV4PassManager(
        default_passes(pass_devices.split(",") if pass_devices else None))
    step_fn = compile_step(engine.stack, backend=backend, passes=passes)
    times = []
    with torch.no_grad():
        for _ in range(2):
            start = time.perf_counter()
            step_fn(x, step)
            if device != "cpu":
                torch.cuda.synchronize()
            times.append(time.perf_counter() - start)
    metrics = torch._dynamo.utils.compilation_time_metrics
    counters = torch._dynamo.utils.counters
    return {"first_call_s": times[0], "second_call_s": times[1],
            **{k: sum(metrics.get(name, [0.0])) for k, name in _TIMERS.items()},
            "phases": {name: round(sum(t), 2) for name, t in metrics.items() if sum(t) >= _PHASE_MIN_S},
            "frames": counters["stats"]["unique_graphs"], "graph_breaks": sum(counters["graph_break"].values()),
            **{f"{group}_{event}": counters[group][key] for group, prefix in _CACHES.items()
               for event in ("hit", "miss", "bypass") for key in [f"{prefix}_{event}"]}}


def run(args) -> list[dict]:
    """Every case in a child process; cold then warm on one fresh Inductor cache directory."""
    results = []
    for layers in (int(n) for n in args.layers.split(",")):
        for backend in args.backends.split(","):
            with tempfile.TemporaryDirectory() as cache_dir:
                for state in ("cold", "warm"):
                    case = dict(layers=layers, backend=backend, cache=state, device=args.device, preset=args.preset,
                                pass_devices=args.pass_devices)
                    row = {**case, **_child(args, case, cache_dir)}
                    print(json.dumps(row), flush=True)
                    results.append(row)
    return results


def _child(args, case: dict, cache_dir: str) -> dict:
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": cache_dir}
    cmd = [sys.executable, __file__, "--case", json.dumps(case), "--preset", args.preset, "--device", args.device]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if done.returncode:  # the last line naming an exception (Dynamo appends advice after it)
        errors = [line for line in done.stderr.splitlines() if "Error" in line or "Exception" in line]
        return {"error": errors[-1] if errors else f"exit status {done.returncode}"}
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    args = parse_args()
    if args.case:
        case = json.loads(args.case)
        print(json.dumps(run_case(case["layers"], case["backend"], args.preset, args.device, case["pass_devices"])))
        return
    results = run(args)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"torch": torch.__version__, "device": args.device, "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
