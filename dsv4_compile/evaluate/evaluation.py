"""One evaluation: a model on the backend over a corpus, the task's figures, and the comparison
with ``transformers`` eager on a sample of the inputs."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import torch
from torch._dynamo.utils import counters
from torch.distributed.device_mesh import init_device_mesh

from .eager import compare_generations, compare_scores, sample
from .inputs import Corpus, builtin_model, load_checkpoint
from .run import Timing, generate_all, make_runner, perplexity, score_all, timed

# Sequences compared with transformers eager unless every one is (``compare_all``).
EAGER_SAMPLE = 8
_LAYER_NAMES = {"sliding_attention": "sliding", "compressed_sparse_attention": "CSA",
                "heavily_compressed_attention": "HCA"}


@dataclass
class Plan:
    """Everything an evaluation needs, checked (:mod:`dsv4_compile.evaluate.inputs`)."""

    config: object  # the model's DeepseekV4Config
    corpus: Corpus
    device: torch.device
    model_dir: Path | None = None  # None: the built-in model drawn from ``seed``
    seed: int = 0
    task: str = "perplexity"  # or "generate"
    max_new_tokens: int = 16
    batch: int = 8
    max_seq_len: int = 1024
    compiled: bool = True
    compare_all: bool = False
    tp_size: int = 1  # > 1: one process of a torchrun group of this many, tensor-parallel


def evaluate(plan: Plan) -> dict:
    """Run ``plan``: the results as a JSON-ready dict (see :func:`dsv4_compile.evaluate.report.summary`)."""
    # torchrun's ranks: init_device_mesh joins the process group its environment describes
    mesh = init_device_mesh(plan.device.type, (plan.tp_size,)) if plan.tp_size > 1 else None
    runner, how = make_runner(load_model(plan), batch=plan.batch, max_seq_len=plan.max_seq_len,
                              compiled=plan.compiled, device_mesh=mesh)
    try:
        results = _perplexity(plan, runner) if plan.task == "perplexity" else _generate(plan, runner)
        # frames compiled after warm-up, by the loop and by the eager comparison's steps
        frames = counters["frames"]["total"] - results.pop("frames_after_warmup")
        results["recompiles_after_warmup"] = frames if runner.step_fn is not runner.backend else None
        if mesh is not None:  # no rank closes its connections while a peer may still be reading from them
            torch.distributed.barrier()
    finally:
        runner.backend.close()
        if mesh is not None:
            torch.distributed.destroy_process_group()
    lengths = [len(s) for s in plan.corpus.sequences]
    return {"model": describe(plan), "device": str(plan.device), "step": how, "task": plan.task,
            "sequences": len(lengths), "min_length": min(lengths), "max_length": max(lengths), **results}


def load_model(plan: Plan) -> torch.nn.Module:
    """The plan's model on its device: the checkpoint (each rank's shards under tensor parallelism),
    or the built-in model drawn from its seed (the same weights on every rank)."""
    if plan.model_dir is None:
        return builtin_model(plan.device, plan.seed)
    return load_checkpoint(plan.model_dir, plan.config, plan.device, plan.tp_size)


def _perplexity(plan: Plan, runner) -> dict:
    sequences = plan.corpus.sequences
    log_probs, timing = timed(runner, lambda: score_all(runner, sequences))
    eager = None
    if plan.tp_size == 1:  # transformers eager runs the whole model
        picked = sample([len(s) for s in sequences], None if plan.compare_all else EAGER_SAMPLE)
        eager = compare_scores(runner, [sequences[i] for i in picked])
    return {**_timing(timing, plan.corpus.num_tokens), "perplexity": perplexity(log_probs),
            "scored_tokens": sum(t.numel() for t in log_probs), "eager": eager}


def _generate(plan: Plan, runner) -> dict:
    prompts, n = plan.corpus.sequences, plan.max_new_tokens
    outputs, timing = timed(runner, lambda: generate_all(runner, prompts, n))
    eager = None
    if plan.tp_size == 1:  # transformers eager runs the whole model
        picked = sample([len(s) for s in prompts], None if plan.compare_all else EAGER_SAMPLE)
        gen = compare_generations(runner.backend.model, [prompts[i] for i in picked], [outputs[i] for i in picked],
                                  n)
        eager = {**compare_scores(runner, [prompts[i] + e for i, e in zip(picked, gen.pop("eager"))]), **gen}
    new_tokens = sum(map(len, outputs))
    return {**_timing(timing, plan.corpus.num_tokens + new_tokens), "new_tokens": new_tokens,
            "new_tokens_per_s": new_tokens / timing.loop_s, "eager": eager, "outputs": outputs}


def _timing(timing: Timing, tokens: int) -> dict:
    return {"tokens": tokens, "tokens_per_s": tokens / timing.loop_s, "loop_s": timing.loop_s,
            "warmup_s": timing.warmup_s, "compile_s": timing.compile_s,
            "frames_after_warmup": timing.frames_after_warmup}


def describe(plan: Plan) -> str:
    """The model in one line: where from, layer types, MoE layer types, sizes."""
    c = plan.config
    layers = ", ".join(f"{n} {_LAYER_NAMES.get(t, t)}" for t, n in Counter(c.layer_types).items())
    moe = ", ".join(f"{n} {t}" for t, n in Counter(c.mlp_layer_types).items())
    source = f"built-in, random weights (seed {plan.seed})" if plan.model_dir is None else str(plan.model_dir)
    return (f"{source}: {c.num_hidden_layers} layers ({layers}; {moe}), hidden {c.hidden_size}, "
            f"{c.hc_mult} hyper-connection streams, vocab {c.vocab_size}")
