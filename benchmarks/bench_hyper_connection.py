"""One hyper-connection (mHC) of the Flash width three ways, compiled by Inductor, side by side:
kernels and µs per call.

Usage:
    python benchmarks/bench_hyper_connection.py --out benchmarks/results/bench_hyper_connection_<date>.json \\
        --plot benchmarks/results/bench_hyper_connection_<date>.png          # on a CUDA machine

The module: transformers' ``DeepseekV4HyperConnection`` of ``DeepseekV4Config()``'s defaults (hidden
4096, 4 streams, 20 Sinkhorn iterations, as the released Flash config), on ``[1, T, 4, 4096]`` bf16 streams for each ``--tokens`` T.
The ways: ``torch.compile(hc, fullgraph=True)`` with the dsv4 pass list without ``FuseSinkhornPass``
(``unfused``) or with it (``fused``), and the module run as ``dsv4::hc_pre`` (``ops``: what the
model step calls, ``dsv4_compile.hf_hyper_connection.pre``), compiled the same way. Measured:
kernel launches per call (``torch.profiler`` over ``--iters`` calls) and µs per call over
CUDA-graph replays of 20 calls (``testing.bench.graph_us``); max |Δ comb| of each way against
``unfused``.

Between two blocks the model step calls ``dsv4::hc_post_pre`` (a block's mix, then the next
hyper-connection). ``post_pre`` in each case times that op both ways it can run, µs per call over
CUDA-graph replays: ``in_projection`` (the projection's programs make the new streams: 2 launches)
and ``apart`` (``hc_post``, then ``hc_pre``: 3), whatever the op's token threshold
(``POSTED_MAX_TOKENS``) would pick.

``with_products`` in each case of at most ``COLLAPSE_MAX_TOKENS`` tokens (one) times
``hc_post_pre`` followed by the products of its collapse, for each of :data:`PRODUCT_GROUPS`:
``apart`` (the op, then ``dsv4::linears``) and ``fused`` (``dsv4::hc_post_pre_linears``, what
``FuseCollapseLinearsPass`` puts in its place), µs per call over CUDA-graph replays.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from transformers import DeepseekV4Config
from transformers.models.deepseek_v4.modeling_deepseek_v4 import DeepseekV4HyperConnection

from dsv4_compile import hf_hyper_connection
from dsv4_compile.fx_passes import DSV4PassManager, FuseSinkhornPass, FuseStepMetadataPass
from dsv4_compile.ops.kernels.linear import COLLAPSE_MAX_TOKENS
from dsv4_compile.testing.bench import graph_us, header, posted_max_tokens, profile_steps

# way -> (what is compiled, given the module; its dsv4 pass list)
WAYS = {"unfused": (lambda hc: hc, lambda: DSV4PassManager([FuseStepMetadataPass()])),
        "fused": (lambda hc: hc, lambda: DSV4PassManager([FuseStepMetadataPass(), FuseSinkhornPass()])),
        "ops": (lambda hc: lambda streams: hf_hyper_connection.pre(hc, streams), DSV4PassManager)}


# hc_post_pre's two ways: the most tokens for which the projection makes the new streams
POST_PRE_WAYS = {"in_projection": 1 << 30, "apart": 0}


def post_pre_us(hc, streams: torch.Tensor) -> dict[str, float]:
    """µs per ``hc_post_pre`` call on ``streams [1, T, N, D]`` (a block output and the previous
    hyper-connection's weights drawn alongside), each of :data:`POST_PRE_WAYS`."""
    post, comb, _ = hf_hyper_connection.pre(hc, torch.randn_like(streams))
    out = torch.randn_like(streams[:, :, 0])
    timed = {}
    for name, limit in POST_PRE_WAYS.items():
        with posted_max_tokens(limit):
            timed[name] = graph_us(lambda: hf_hyper_connection.post_pre(post, comb, out, streams, hc), iters=20, inner=20)
    return timed


# products of a block's normed input in the Flash model (rows of each weight, K 4096): a sliding
# layer's q_a + kv and a learned router of 256 experts (launches that split K: the fused op makes the
# collapse in them), a CSA layer's seven projections (whole-K programs: the fused op runs the two
# ops' launches)
PRODUCT_GROUPS = {"sliding q_a + kv": (1024, 512), "router": (256,),
                  "csa projections": (1024, 512, 1024, 1024, 512, 64)}


def with_products_us(hc, streams: torch.Tensor) -> dict[str, dict[str, float]]:
    """µs per ``hc_post_pre`` and the products of its collapse on ``streams [1, T, N, D]``, each of
    :data:`PRODUCT_GROUPS` apart and fused."""
    post, comb, _ = hf_hyper_connection.pre(hc, torch.randn_like(streams))
    out = torch.randn_like(streams[:, :, 0])
    d = streams.shape[-1]
    norm = torch.ones(d, device=streams.device)
    settings = (hc.fn, hc.base, hc.scale, hc.hc_sinkhorn_iters, hc.hc_eps, hc.input_norm.eps, norm, 1e-6)
    ops = torch.ops.dsv4
    timed = {}
    for name, rows in PRODUCT_GROUPS.items():
        weights = [torch.randn(r, d, device=streams.device).bfloat16() * 0.02 for r in rows]

        def apart():
            collapsed = ops.hc_post_pre(post, comb, out, streams, *settings)[3]
            return ops.linears(collapsed.view(-1, d), weights)

        def fused():
            return ops.hc_post_pre_linears(post, comb, out, streams, *settings, weights)
        timed[name] = {way: graph_us(fn, iters=20, inner=20) for way, fn in (("apart", apart), ("fused", fused))}
    return timed


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
    # the ways compile one code object (the module's forward) once per token count each
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit,
                                               len(WAYS) * len(args.tokens.split(",")))
    compiled = {name: torch.compile(target(hc), fullgraph=True, dynamic=False,
                                    options={"post_grad_custom_post_pass": passes()})
                for name, (target, passes) in WAYS.items()}
    with torch.no_grad():
        for t in map(int, args.tokens.split(",")):
            streams = torch.randn(1, t, hc.hc_mult, hc.fn.shape[1] // hc.hc_mult, device="cuda").bfloat16()
            case, combs = {"tokens": t}, {}
            for name, fn in compiled.items():
                combs[name] = fn(streams)[1].clone()
                prof = profile_steps(lambda n: [fn(streams) for _ in range(n)], args.iters)
                case[name] = {"kernels": prof["kernels"], "top": prof["top"], "us": graph_us(lambda: fn(streams), iters=20, inner=20)}
            for name in WAYS:
                case[name]["max_abs_diff_comb"] = (combs[name] - combs["unfused"]).abs().max().item()
            case["post_pre"] = post_pre_us(hc, streams)
            if t <= COLLAPSE_MAX_TOKENS:
                case["with_products"] = with_products_us(hc, streams)
            results["cases"].append(case)
            print(f"T {t:5d} | " + " | ".join(f"{name} {case[name]['kernels']:5.1f} kernels {case[name]['us']:7.2f} us "
                                              f"(|Δ comb| {case[name]['max_abs_diff_comb']:.1e})" for name in WAYS)
                  + " | post_pre " + " ".join(f"{name} {us:.2f} us" for name, us in case["post_pre"].items()),
                  flush=True)
            for group, timed in case.get("with_products", {}).items():
                print(f"        with {group}: " + " ".join(f"{way} {us:.2f} us" for way, us in timed.items()),
                      flush=True)
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
        ax.bar([x + 0.28 * i for x in xs], [c[name]["us"] for c in cases], width=0.28, label=name)
    ax.set_xticks([x + 0.28 for x in xs], [str(c["tokens"]) for c in cases])
    ax.set_xlabel("tokens")
    ax.set_ylabel("µs per call (CUDA-graph replay)")
    ax.set_title(f"hyper-connection, hidden 4096: {results['device']}, {results['date']}")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
