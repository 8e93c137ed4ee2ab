"""The reference an evaluation is compared with: ``transformers``' own eager forward of the same
model (its class's ``forward``, which the backend leaves in place), one sequence at a time.

Two comparisons: teacher-forced — the log-prob of each next token and the argmax at each position
(mean / max |Δ log-prob|, greedy agreement) — and greedy generation, token by token. The model's
real tokens and positions are the same on both sides; what differs is the FP8 cache and the
sparse kernels (docs/semantics.md §7).
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

import torch
from tqdm import tqdm

from ..runner import ModelRunner


@torch.no_grad()
def eager_logits(model: torch.nn.Module, tokens: list[int], past=None) -> tuple[torch.Tensor, object]:
    """``transformers``' eager logits ``[L, vocab]`` fp32 of ``tokens`` (continuing the cache
    ``past`` when given) and the cache after them."""
    ids = torch.tensor([tokens], dtype=torch.int64, device=model.device)
    out = type(model).forward(model, input_ids=ids, past_key_values=past, use_cache=True)
    return out.logits[0].float(), out.past_key_values


def eager_greedy(model: torch.nn.Module, prompt: list[int], max_new_tokens: int) -> list[int]:
    """``transformers``' eager greedy continuation of ``prompt`` (``max_new_tokens`` tokens)."""
    logits, past = eager_logits(model, prompt)
    new: list[int] = []
    while True:
        new.append(int(logits[-1].argmax()))
        if len(new) == max_new_tokens:
            return new
        logits, past = eager_logits(model, new[-1:], past)


def sample(lengths: Sequence[int], size: int | None) -> list[int]:
    """Indices of ``size`` sequences spread over the range of ``lengths``, the longest included
    (all of them when ``size`` is None or not smaller)."""
    order = sorted(range(len(lengths)), key=lambda i: (lengths[i], i))
    if size is None or size >= len(order):
        return order
    return sorted({order[(len(order) - 1) * (k + 1) // size] for k in range(size)})


def compare_scores(runner: ModelRunner, sequences: Sequence[list[int]]) -> dict:
    """The runner's logits (compiled step) against ``transformers`` eager, over every predicted
    position of ``sequences``: mean and max |Δ log-prob| of the next token, greedy agreement (the
    fraction of positions where both argmaxes agree)."""
    model, batch = runner.backend.model, runner.allocator.cache.max_requests
    ours, theirs, agree = [], [], 0
    bar = _progress(sequences, "transformers eager")
    for lo in range(0, len(sequences), batch):  # the runner's logits, a batch at a time: [L, vocab] each
        for tokens, logits in zip(sequences[lo:lo + batch], runner.logits(sequences[lo:lo + batch])):
            bar.update()
            if len(tokens) < 2:
                continue
            target = torch.tensor(tokens[1:], device=logits.device)[:, None]
            mine = logits[:-1].float().log_softmax(-1)
            other = eager_logits(model, tokens)[0][:-1].log_softmax(-1)
            ours.append(mine.gather(1, target)[:, 0])
            theirs.append(other.gather(1, target)[:, 0])
            agree += int((mine.argmax(-1) == other.argmax(-1)).sum())
    bar.close()
    diffs = logprob_diffs(ours, theirs)
    return {"sequences": len(sequences), **diffs,
            "greedy_agreement": agree / diffs["tokens"] if diffs["tokens"] else None}


def logprob_diffs(ours: Sequence[torch.Tensor], theirs: Sequence[torch.Tensor]) -> dict:
    """``tokens`` and the mean and max |Δ| (None without tokens) between two lists of log-prob
    tensors, pairwise of the same shape (fp32 ``[L - 1]`` each, as ``ModelRunner.score`` gives)."""
    d = torch.cat([(a.float().cpu() - b.float().cpu()).abs() for a, b in zip(ours, theirs)] or [torch.zeros(0)])
    return {"tokens": d.numel(), "mean_abs_logprob_diff": float(d.mean()) if d.numel() else None,
            "max_abs_logprob_diff": float(d.max()) if d.numel() else None}


def compare_generations(model: torch.nn.Module, prompts: Sequence[list[int]], ours: Sequence[list[int]],
                        max_new_tokens: int) -> dict:
    """The runner's greedy tokens ``ours`` against ``transformers`` eager greedy generation from the
    same ``prompts`` (see :func:`token_agreement`). Returns also the eager continuations (``"eager"``)."""
    theirs = [eager_greedy(model, p, max_new_tokens) for p in _progress(prompts, "transformers eager")]
    return {**token_agreement(ours, theirs), "eager": theirs}


def token_agreement(ours: Sequence[list[int]], theirs: Sequence[list[int]]) -> dict:
    """Two sets of continuations of the same prompts: the fraction of ``theirs``' positions where
    ``ours`` holds the same token, and how many continuations are identical throughout."""
    same = sum(a == b for mine, other in zip(ours, theirs) for a, b in zip(mine, other))
    total = sum(map(len, theirs))
    return {"sequences": len(theirs), "new_tokens": total, "token_agreement": same / total if total else None,
            "identical_continuations": sum(list(a) == list(b) for a, b in zip(ours, theirs))}


def _progress(items: Sequence, what: str) -> tqdm:
    """A progress bar over ``items`` on stderr (shown on a terminal only)."""
    return tqdm(items, total=len(items), desc=what, unit="seq", file=sys.stderr, disable=None, leave=False, dynamic_ncols=True)
