"""Evaluation loops: the scoring and generation loops of ``python -m dsv4_compile`` on one model and
corpus, transformers eager, lm-eval ``hf``-style batched and the backend (eager and compiled), side
by side in one run.

Usage:
    python benchmarks/bench_eval.py --out benchmarks/results/bench_eval_<date>.json \\
        --plot benchmarks/results/bench_eval_<date>.png                 # on a CUDA machine
    python benchmarks/bench_eval.py --tiny --device cpu                # smoke check, any machine
    python benchmarks/bench_eval.py --replot run.json --plot run.png   # plot a saved run

The model and corpus are those of ``python -m dsv4_compile``. The model: by default its built-in
random model (``dsv4_compile/evaluate/default_model.json``: sliding, CSA, HCA and CSA layers,
hash-routed and learned MoE, hidden 256, vocab 512, the real head dimensions), kept at the size the
evaluation runs rather than enlarged: every way is then bound by per-step overheads, which is what
the ways differ in; or a checkpoint (``--model DIR``). The corpus: the built-in one, 200 token
sequences of 16 to 600 tokens drawn from ``--seed`` (``--limit N``: the first N). ``--tiny`` scores
24 sequences (one of 600 tokens, prefilled in chunks) and continues 8 prompts by 8 tokens: a smoke
check of one to three minutes on two CPU cores.

Ways (the same model and weights; the transformers ways run before the backend is enabled, which
replaces the model's forward, ``generate()`` and MoE experts implementation):
    hf_eager       transformers' own model, one sequence at a time: scoring one forward over the
                   whole sequence, generation its ``generate()`` (DynamicCache, greedy)
    hf_batched     lm-eval's ``hf`` model's batching, emulated: sequences sorted longest first,
                   ``--batch`` at a time, right-padded, one forward per batch without a mask (a causal
                   row never attends to the pads after it); generation ``generate()`` over
                   left-padded batches, longest prompts first
    backend_eager  ``ModelRunner`` on the eager step: continuous batching of ``--batch`` requests
    compiled       ``ModelRunner`` on the step compiled as ``python -m dsv4_compile`` compiles it
                   (``evaluate.run.compiled_step``): on one GPU Inductor with whole-step CUDA
                   graphs, on a CPU Dynamo's graph on the eager backend

Loops:
    score      teacher-forced log-probs (fp32) of every token of every sequence after its first
    generate   greedy continuations of ``--max-new-tokens`` tokens (no stop token) of the first
               ``--gen-prompts`` sequences

Measured per way and loop: sequences/s, tokens/s (scored tokens, L - 1 per sequence; generated
tokens) and the loop's wall time, compilation excluded. Per way: the warm-up (the backend:
``ModelRunner.warmup``, which compiles the step; transformers: one sequence scored and continued),
the time in Dynamo's compile callbacks (warm-up, and CUDA-graph recordings during the loops), the
Dynamo frames compiled after warm-up (0 expected: the exit status is 1 otherwise). Against hf_eager:
mean / max |Δ log-prob| of the scored tokens and the greedy tokens' agreement. "compiled vs" = the
other way's loop time / the compiled one's.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import NamedTuple

import torch
from torch._dynamo.utils import counters
from torch.nn.utils.rnn import pad_sequence

from dsv4_compile.config import PAGE_SIZE
from dsv4_compile.evaluate import InputError, Plan
from dsv4_compile.evaluate.eager import logprob_diffs, token_agreement
from dsv4_compile.evaluate.evaluation import describe, load_model
from dsv4_compile.evaluate.inputs import builtin_config, builtin_corpus, checkpoint_config
from dsv4_compile.evaluate.run import generate_all, perplexity, quiet_libraries, runner_on, score_all, timed_after
from dsv4_compile.model import enable
from dsv4_compile.runner import ModelRunner
from dsv4_compile.testing.bench import compiled_ratios, header

WAYS = ("hf_eager", "hf_batched", "backend_eager", "compiled")
LOOPS = ("score", "generate")
DEFAULTS = dict(limit=None, gen_prompts=16, max_new_tokens=32)
TINY_RUN = dict(limit=24, gen_prompts=8, max_new_tokens=8)  # --tiny: explicit flags still win


class Way(NamedTuple):
    """How one way runs: its warm-up and its two loops."""

    warmup: Callable[[], object]
    score: Callable[[list[list[int]]], list[torch.Tensor]]  # sequences -> fp32 [L - 1] log-probs each
    generate: Callable[[list[list[int]], int], list[list[int]]]  # prompts, new tokens -> continuations


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", type=Path, metavar="DIR", help="checkpoint directory (default: the built-in model)")
    p.add_argument("--limit", type=int, help="the first N sequences of the corpus (default: all 200)")
    p.add_argument("--gen-prompts", type=int, help="sequences continued by the generation loop (default 16)")
    p.add_argument("--max-new-tokens", type=int, help="tokens generated per prompt (default 32)")
    p.add_argument("--batch", type=int, default=8, help="the runner's request rows; hf_batched's batch size")
    p.add_argument("--ways", default=",".join(WAYS))
    p.add_argument("--tiny", action="store_true", help="24 sequences, 8 prompts of 8 new tokens: a smoke check")
    p.add_argument("--device", default="cuda")
    p.add_argument("--seed", type=int, default=0, help="built-in model weights and corpus")
    p.add_argument("--out", help="write the results as JSON")
    p.add_argument("--plot", help="write a PNG of the results")
    p.add_argument("--replot", help="plot a saved JSON (with --plot) instead of running")
    args = p.parse_args(argv)
    for name, value in {**DEFAULTS, **(TINY_RUN if args.tiny else {})}.items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    args.ways = args.ways.split(",")
    if unknown := set(args.ways) - set(WAYS):
        p.error(f"--ways: unknown {sorted(unknown)}; choose from {WAYS}")
    return args


def make_plan(args: argparse.Namespace) -> Plan:
    """The model, the corpus (its first ``--limit`` sequences) and a cache of ``--batch`` rows long
    enough for every sequence and every prompt with its new tokens."""
    config = builtin_config() if args.model is None else checkpoint_config(args.model)
    corpus = builtin_corpus(config.vocab_size, args.seed).head(args.limit)
    prompt = max(map(len, prompts_of(corpus.sequences, args)))
    longest = max(max(map(len, corpus.sequences)), prompt + args.max_new_tokens)
    return Plan(config=config, corpus=corpus, device=torch.device(args.device), model_dir=args.model,
                seed=args.seed, max_new_tokens=args.max_new_tokens, batch=args.batch,
                max_seq_len=-(-longest // PAGE_SIZE) * PAGE_SIZE)


def prompts_of(sequences: list[list[int]], args: argparse.Namespace) -> list[list[int]]:
    return sequences[:args.gen_prompts]


# -- transformers ----------------------------------------------------------------------------------

def longest_first(sequences: list[list[int]], batch: int) -> list[list[int]]:
    """Indices of ``sequences`` in batches of ``batch``, longest first (lm-eval's order)."""
    order = sorted(range(len(sequences)), key=lambda i: -len(sequences[i]))
    return [order[lo:lo + batch] for lo in range(0, len(order), batch)]


def padded(rows: list[list[int]], side: str, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """``rows`` padded with token 0 on ``side``: ids and attention mask, ``[len(rows), longest]`` int64."""
    ids = [torch.tensor(r, dtype=torch.int64) for r in rows]
    ones = [torch.ones_like(t) for t in ids]
    return tuple(pad_sequence(t, batch_first=True, padding_side=side).to(device) for t in (ids, ones))


def hf_score(model, sequences: list[list[int]], batch: int) -> list[torch.Tensor]:
    """Log-probs, fp32 ``[L - 1]`` each (as ``ModelRunner.score``), from transformers' own forward:
    ``batch`` right-padded sequences per forward, called as lm-eval's ``hf`` model calls it
    (``model(ids).logits``; with ``batch`` 1 one forward per whole sequence)."""
    out: list[torch.Tensor] = [torch.zeros(0)] * len(sequences)
    for group in longest_first(sequences, batch):
        ids, _ = padded([sequences[i] for i in group], "right", model.device)
        logits = model(ids).logits  # [b, longest, vocab]
        for row, i in enumerate(group):
            n = len(sequences[i])
            target = ids[row, 1:n, None]
            out[i] = logits[row, :n - 1].float().log_softmax(-1).gather(1, target)[:, 0]
    return out


def hf_generate(model, prompts: list[list[int]], max_new_tokens: int, batch: int) -> list[list[int]]:
    """Greedy continuations from transformers' own ``generate()`` (DynamicCache), ``batch``
    left-padded prompts per call, longest first; exactly ``max_new_tokens`` each (no EOS)."""
    out: list[list[int]] = [[] for _ in prompts]
    for group in longest_first(prompts, batch):
        ids, mask = padded([prompts[i] for i in group], "left", model.device)
        new = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=max_new_tokens, do_sample=False,
                             eos_token_id=None, pad_token_id=0)[:, ids.shape[1]:]
        for row, i in enumerate(group):
            out[i] = new[row].tolist()
    return out


def hf_way(model, batch: int, warm: list[int]) -> Way:
    """transformers' own model, ``batch`` sequences per call (1: hf_eager); warm-up on ``warm``."""
    return Way(warmup=lambda: (hf_score(model, [warm], batch), hf_generate(model, [warm], 2, batch)),
               score=partial(hf_score, model, batch=batch), generate=partial(hf_generate, model, batch=batch))


def runner_way(runner: ModelRunner) -> Way:
    """The runner's loops as ``python -m dsv4_compile`` runs them; its warm-up compiles the step."""
    return Way(warmup=runner.warmup, score=partial(score_all, runner), generate=partial(generate_all, runner))


# -- the run ---------------------------------------------------------------------------------------

def rates(sequences: int, tokens: int, seconds: float) -> dict:
    return {"sequences": sequences, "tokens": tokens, "loop_s": seconds, "sequences_per_s": sequences / seconds,
            "tokens_per_s": tokens / seconds}


def measure(way: Way, plan: Plan, prompts: list[list[int]]) -> tuple[dict, tuple]:
    """Warm ``way`` up, then run its scoring and its generation loop: the figures and the outputs
    (log-probs, continuations)."""
    sequences, n = plan.corpus.sequences, plan.max_new_tokens
    log_probs, scoring = timed_after(way.warmup, lambda: way.score(sequences), plan.device)
    outputs, generating = timed_after(lambda: None, lambda: way.generate(prompts, n), plan.device)
    figures = {"warmup_s": scoring.warmup_s, "compile_s": scoring.compile_s + generating.compile_s,
               "recompiles_after_warmup": counters["frames"]["total"] - scoring.frames_after_warmup,
               "score": {**rates(len(sequences), sum(t.numel() for t in log_probs), scoring.loop_s),
                         "perplexity": perplexity(log_probs)},
               "generate": rates(len(prompts), sum(map(len, outputs)), generating.loop_s)}
    return figures, (log_probs, outputs)


def measure_all(model, plan: Plan, args: argparse.Namespace) -> tuple[dict, dict]:
    """Every way of ``--ways``, transformers' first: figures and outputs by way."""
    prompts, backend = prompts_of(plan.corpus.sequences, args), None
    figures, outputs = {}, {}
    for name in [w for w in WAYS if w in args.ways]:
        if name.startswith("hf_"):
            way, how = hf_way(model, 1 if name == "hf_eager" else plan.batch, prompts[0]), "transformers eager"
        else:
            backend = backend or enable(model, max_requests=plan.batch, max_seq_len=plan.max_seq_len)
            runner, how = runner_on(backend, compiled=name == "compiled")
            way = runner_way(runner)
        print(f"{name}: warm-up and loops ...", file=sys.stderr, flush=True)
        figures[name], outputs[name] = measure(way, plan, prompts)
        figures[name]["step"] = how
        _report(name, figures[name])
    if backend is not None:
        backend.close()
    return figures, outputs


def cross_check(figures: dict, outputs: dict) -> None:
    """Each way's outputs against hf_eager's: |Δ log-prob| of the scored tokens, greedy agreement."""
    if "hf_eager" not in outputs:
        return
    log_probs, continuations = outputs["hf_eager"]
    for way, (mine, generated) in outputs.items():
        if way != "hf_eager":
            figures[way]["score"]["vs_hf_eager"] = logprob_diffs(mine, log_probs)
            figures[way]["generate"]["vs_hf_eager"] = token_agreement(generated, continuations)


def run(args: argparse.Namespace) -> dict:
    plan = make_plan(args)
    torch.set_grad_enabled(False)
    model = load_model(plan)
    hf_experts = model.config._experts_implementation
    figures, outputs = measure_all(model, plan, args)
    cross_check(figures, outputs)
    ratios = {loop: compiled_ratios({w: f[loop]["loop_s"] for w, f in figures.items()}) for loop in LOOPS}
    return {**header(args.device, args), "model": describe(plan), "hf_experts_implementation": hf_experts,
            "max_seq_len": plan.max_seq_len, "ways": figures, "compiled_vs": ratios}


# -- output ----------------------------------------------------------------------------------------

def _report(way: str, f: dict) -> None:
    print(f"{way:14s} warm-up {f['warmup_s']:6.1f} s | " + " | ".join(
        f"{loop} {f[loop]['tokens_per_s']:9.1f} tok/s in {f[loop]['loop_s']:6.2f} s" for loop in LOOPS), flush=True)


def _agreement(loop: str, check: dict | None) -> str:
    if check is None:
        return "—"
    if loop == "score":
        return f"{check['mean_abs_logprob_diff']:.4f} (max {check['max_abs_logprob_diff']:.3f})"
    return f"{100 * check['token_agreement']:.1f} % ({check['identical_continuations']}/{check['sequences']})"


def print_table(res: dict) -> None:
    """The run as a markdown table (loop x way), then warm-up, compilation and recompiles."""
    print(f"\n{res['model']}\n{res['device']}, torch {res['torch']}, transformers {res['transformers']}, "
          f"commit {res['commit']}\n")
    print("| loop | way | sequences/s | tokens/s | loop s | vs hf_eager | compiled vs |")
    print("|---|---|---|---|---|---|---|")
    for loop in LOOPS:
        for way, f in res["ways"].items():
            r, ratio = f[loop], res["compiled_vs"][loop].get(f"compiled_vs_{way}")
            print(f"| {loop} | {way} | {r['sequences_per_s']:.2f} | {r['tokens_per_s']:.1f} | {r['loop_s']:.2f} | "
                  f"{_agreement(loop, r.get('vs_hf_eager'))} | {'—' if ratio is None else f'{ratio:.3g}x'} |")
    print("\nvs hf_eager: score, mean (max) |Δ log-prob| of the scored tokens; generate, greedy tokens the same "
          "(continuations identical throughout)")
    print("warm-up s (compilation s): " + ", ".join(
        f"{w} {f['warmup_s']:.1f} ({f['compile_s']:.1f})" for w, f in res["ways"].items()))
    print("perplexity: " + ", ".join(f"{w} {f['score']['perplexity']:.2f}" for w, f in res["ways"].items()))
    if "compiled" in res["ways"]:
        print(f"compiled: {res['ways']['compiled']['recompiles_after_warmup']} Dynamo frames compiled after warm-up")


def plot(res: dict, png: str) -> None:
    """Tokens/s per way, one bar chart per loop (log scale)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.5))
    for ax, loop in zip(axes, LOOPS):
        ways = list(res["ways"])
        bars = ax.bar(ways, [res["ways"][w][loop]["tokens_per_s"] for w in ways],
                      color=[f"C{WAYS.index(w)}" for w in ways])
        ax.bar_label(bars, fmt="%.0f", fontsize=8)
        first = res["ways"][ways[0]][loop]
        what = "scored" if loop == "score" else "generated"
        ax.set(yscale="log", ylabel=f"{what} tokens/s", title=f"{loop}: {first['sequences']} sequences, "
               f"{first['tokens']:,} {what} tokens")
        ax.tick_params(axis="x", labelsize=8)
    warm = res["ways"].get("compiled", {}).get("warmup_s")
    compiled = "" if warm is None else f"; compiled warm-up {warm:.0f} s, not in tokens/s"
    fig.suptitle(f"evaluation loops, {res['device']}{compiled}\n{res['model']}", fontsize=8)
    fig.tight_layout()
    fig.savefig(png, dpi=120)


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.replot:
        with open(args.replot) as f:
            plot(json.load(f), args.plot or args.replot.removesuffix(".json") + ".png")
        return 0
    quiet_libraries()
    start = time.perf_counter()
    try:
        res = run(args)
    except InputError as e:
        print(f"bench_eval: error: {e}", file=sys.stderr)
        return 2
    res["run_s"] = time.perf_counter() - start
    print_table(res)
    print(f"whole run: {res['run_s']:.0f} s")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(res, f, indent=1)
    if args.plot:
        plot(res, args.plot)
    return 1 if res["ways"].get("compiled", {}).get("recompiles_after_warmup") else 0


if __name__ == "__main__":
    sys.exit(main())
