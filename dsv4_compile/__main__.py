"""Evaluate a DeepSeek V4 model on the compiled backend.

Usage:
    python -m dsv4_compile                                 # built-in model and corpus, perplexity
    python -m dsv4_compile --model DIR --data FILE.jsonl   # a checkpoint on your own sequences
    python -m dsv4_compile --task generate --json out.json # greedy generation, results as JSON
    torchrun --nproc-per-node 2 -m dsv4_compile            # tensor-parallel over 2 processes

Without ``--model`` it builds a small random DeepSeek V4 model (every attention layer type, hash
and learned MoE layers, hyper-connections) from the config shipped in the package, and without
``--data`` it scores a corpus of token sequences drawn from ``--seed`` (16 to 600 tokens long).
The runner scores (``--task perplexity``) or greedily continues (``--task generate``) every
sequence with continuous batching, after a warm-up that compiles every frame the step needs.
The summary gives tokens/s (compilation excluded), warm-up and compilation time, the Dynamo frames
compiled after warm-up (0 expected; the exit status is 1 otherwise), the perplexity, and the
agreement with ``transformers`` eager on a sample of the sequences (all with ``--compare-eager``).
Under torchrun the model runs tensor-parallel over the processes (one GPU each, or the CPU), with
no comparison with ``transformers`` eager (which needs the whole model); the first rank prints.
Bad input ends in one error line and exit status 2.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from .config import PAGE_SIZE
from .evaluate import InputError, Plan, evaluate
from .evaluate.inputs import (builtin_config, builtin_corpus, check_device, check_lengths, check_output_file,
                              check_tp_size, checkpoint_config, read_jsonl)
from .evaluate.report import summary, write_json
from .evaluate.run import quiet_libraries

PROG = "python -m dsv4_compile"


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # one line, as for every other bad input
        raise InputError(message)


def _count(text: str) -> int:
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a positive integer")
    return int(text)


def parse_args(argv=None) -> argparse.Namespace:
    p = _Parser(prog=PROG, description=__doc__.split("\n\n")[0])
    p.add_argument("--model", type=Path, metavar="DIR", help="checkpoint directory (config.json, safetensors)")
    p.add_argument("--data", type=Path, metavar="FILE",
                   help='JSONL: {"tokens": [ids...]} or {"text": "..."} (the checkpoint\'s tokenizer) a line')
    p.add_argument("--task", choices=("perplexity", "generate"), default="perplexity")
    p.add_argument("--max-new-tokens", type=_count, default=16, help="generate: tokens per sequence")
    p.add_argument("--device", help="cpu, cuda or cuda:N (default: cuda when there is one)")
    p.add_argument("--batch", type=_count, default=8, help="requests running at once")
    p.add_argument("--max-seq-len", type=_count,
                   help=f"positions per request, a multiple of {PAGE_SIZE} (default: the longest sequence's)")
    p.add_argument("--compile", action=argparse.BooleanOptionalAction, default=True,
                   help="compile the step (default) or run it eagerly")
    p.add_argument("--json", type=Path, metavar="OUT", help="write the results as JSON")
    p.add_argument("--compare-eager", action="store_true", help="compare every sequence with transformers eager")
    p.add_argument("--limit", type=_count, metavar="N", help="the first N sequences only")
    p.add_argument("--seed", type=int, default=0, help="built-in model weights and corpus")
    return p.parse_args(argv)


def make_plan(args: argparse.Namespace) -> Plan:
    """The checked :class:`Plan` of the command line; :class:`InputError` names what is wrong."""
    ranks, local_rank = _torchrun_ranks()
    device = check_device(args.device, local_rank if ranks > 1 else None)
    if ranks > 1 and args.compare_eager:
        raise InputError("--compare-eager: transformers eager needs the whole model in one process, not under torchrun")
    if args.json is not None:
        check_output_file("--json", args.json)
    if not 0 <= args.seed < 2**63:
        raise InputError(f"--seed {args.seed}: must lie in [0, 2**63)")
    if args.max_seq_len is not None and args.max_seq_len % PAGE_SIZE:
        raise InputError(f"--max-seq-len {args.max_seq_len}: must be a multiple of {PAGE_SIZE}")
    config = builtin_config() if args.model is None else checkpoint_config(args.model)
    if ranks > 1:  # (one process: checkpoint_config has checked the config as it is)
        check_tp_size(config, ranks)
    if args.max_seq_len is not None and args.max_seq_len > config.max_position_embeddings:
        raise InputError(f"--max-seq-len {args.max_seq_len}: the model's max_position_embeddings is "
                         f"{config.max_position_embeddings}")
    if args.data is None:
        corpus = builtin_corpus(config.vocab_size, args.seed)
    else:
        corpus = read_jsonl(args.data, config.vocab_size, args.model)
    corpus = corpus.head(args.limit)
    new_tokens = args.max_new_tokens if args.task == "generate" else 0
    longest = max(map(len, corpus.sequences)) + new_tokens
    max_seq_len = args.max_seq_len or -(-longest // PAGE_SIZE) * PAGE_SIZE
    check_lengths(corpus, max_seq_len, new_tokens)
    return Plan(config=config, corpus=corpus, device=device, model_dir=args.model, seed=args.seed, task=args.task,
                max_new_tokens=args.max_new_tokens, batch=args.batch, max_seq_len=max_seq_len,
                compiled=args.compile, compare_all=args.compare_eager, tp_size=ranks)


def _torchrun_ranks() -> tuple[int, int]:
    """``(WORLD_SIZE, LOCAL_RANK)`` that torchrun sets (1 and 0 without it)."""
    return int(os.environ.get("WORLD_SIZE", "1")), int(os.environ.get("LOCAL_RANK", "0"))


def main(argv=None) -> int:
    try:
        args = parse_args(argv)
        plan = make_plan(args)
        quiet_libraries()
        results = evaluate(plan)  # a checkpoint whose weights cannot be read fails here
    except InputError as e:
        print(f"{PROG}: error: {e}", file=sys.stderr)
        return 2
    if int(os.environ.get("RANK", "0")) == 0:  # under torchrun every rank has the same results
        print(summary(results))
        if args.json is not None:
            write_json(results, args.json)
    return 0 if not results["recompiles_after_warmup"] else 1


if __name__ == "__main__":
    sys.exit(main())
