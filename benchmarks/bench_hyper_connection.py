"""One hyper-connection (mHC) of the Flash width, compiled by Inductor with and without
``FuseSinkhornPass``, side by side: kernels and µs per call.

Usage:
    python benchmarks/bench_hyper_connection.py --out benchmarks/results/bench_hyper_connection_<date>.json \\
        --plot benchmarks/results/bench_hyper_connection_<date>.png          # on a CUDA machine

The module: transformers' ``DeepseekV4HyperConnection`` of ``DeepseekV4Config()``'s defaults (hidden
4096, 4 streams, 20 Sinkhorn iterations, as the released Flash config), on ``[1, T, 4, 4096]`` bf16 streams for each ``--tokens`` T.
Each way is ``torch.compile(hc, fullgraph=True)`` with the dsv4 pass list without the pass
(``unfused``) or with it (``fused``). Measured: kernel launches per call (``torch.profiler`` over
``--iters`` calls) and µs per call over CUDA-graph replays of 20 calls (``testing.bench.graph_us``);
max |Δ comb| between the ways.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from transformers import DeepseekV4Config
from transformers.models.deepseek_v4.modeling_deepseek_v4 import DeepseekV4HyperConnection

from dsv4_compile.fx_passes import DSV4PassManager, FuseSinkhornPass, FuseStepMetadataPass
from dsv4_compile.testing.bench import graph_us, header, profile_steps

WAYS = {"unfused": lambda: DSV4PassManager([FuseStepMetadataPass()]),
        "fused": lambda: DSV4PassManager([FuseStepMetadataPass(), FuseSinkhornPass()])}


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", default="1,8,64,512")
    p.add_argument("--iters", type=int, default=50)
    p.add_argument("--out")
    p.add_argument("--plot")
    return p.parse_args(argv)


def main(argv=None) -> dict:
    args = parse_args(argv)
    hc = DeepseekV4HyperConnection(DeepseekV4Config()).cuda()
    with torch.no_grad():
        for p in (hc.fn, hc.base, hc.scale):
            p.normal_(std=0.5)
    results = {**header("cuda", args), "cases": []}
    compiled = {name: torch.compile(hc, fullgraph=True, dynamic=False, options={"post_grad_custom_post_pass": make()})
                for name, make in WAYS.items()}
    with torch.no_grad():
        for t in map(int, args.tokens.split(",")):
            streams = torch.randn(1, t, hc.hc_mult, hc.fn.shape[1] // hc.hc_mult, device="cuda").bfloat16()
            case, combs = {"tokens": t}, {}
            for name, fn in compiled.items():
                combs[name] = fn(streams)[1].clone()
                prof = profile_steps(lambda n: [fn(streams) for _ in range(n)], args.iters)
                case[name] = {"kernels": prof["kernels"], "top": prof["top"], "us": graph_us(lambda: fn(streams), iters=20, inner=20)}
            case["max_abs_diff_comb"] = (combs["fused"] - combs["unfused"]).abs().max().item()
            results["cases"].append(case)
            print(f"T {t:5d} | unfused {case['unfused']['kernels']:5.1f} kernels {case['unfused']['us']:7.2f} us"
                  f" | fused {case['fused']['kernels']:5.1f} kernels {case['fused']['us']:7.2f} us"
                  f" | max |Δ comb| {case['max_abs_diff_comb']:.2e}", flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=1))
    if args.plot:
        _plot(results, args.plot)
    return results


def _plot(results: dict, path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cases = results["cases"]
    xs = range(len(cases))
    fig, ax = plt.subplots(figsize=(6, 3.5))
    for i, name in enumerate(WAYS):
        ax.bar([x + 0.4 * i for x in xs], [c[name]["us"] for c in cases], width=0.4, label=name)
    ax.set_xticks([x + 0.2 for x in xs], [str(c["tokens"]) for c in cases])
    ax.set_xlabel("tokens")
    ax.set_ylabel("µs per call (CUDA-graph replay)")
    ax.set_title(f"hyper-connection, hidden 4096: {results['device']}, {results['date']}")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
