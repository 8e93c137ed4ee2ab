"""Next-token choice on the device: greedy, or temperature / top-k / top-p (nucleus) sampling."""

from __future__ import annotations

import torch


def greedy_tokens(logits: torch.Tensor) -> torch.Tensor:
    """``logits [m, vocab]`` -> ``[m] int64``: ``logits.argmax(-1)`` (the first of equal maxima;
    a NaN counts as the maximum), as ``dsv4::greedy_tokens`` (two short launches on CUDA, where
    ``aten``'s argmax runs a row through one thread block)."""
    return torch.ops.dsv4.greedy_tokens(logits)


def check_sampling(temperature: float, top_p: float, top_k: int = 0) -> tuple[float, float, int]:
    """``(temperature, top_p, top_k)``; ``temperature >= 0`` (0: greedy), ``0 < top_p <= 1`` and
    an integer ``top_k >= 0`` (0: no top-k cut)."""
    for name, value in (("temperature", temperature), ("top_p", top_p), ("top_k", top_k)):
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise TypeError(f"{name} must be a number, got {type(value).__name__}")
    if not temperature >= 0:
        raise ValueError(f"temperature={temperature} must be >= 0 (0: greedy)")
    if not 0 < top_p <= 1:
        raise ValueError(f"top_p={top_p} must lie in (0, 1]")
    if top_k < 0 or top_k != int(top_k):
        raise ValueError(f"top_k={top_k} must be an integer >= 0 (0: no cut)")
    return float(temperature), float(top_p), int(top_k)


def sample_tokens(logits: torch.Tensor, temperature: float, top_p: float,
                  generator: torch.Generator | None, top_k: int = 0) -> torch.Tensor:
    """One token per row of ``logits [m, vocab]`` -> ``[m] int64``, on the logits' device.

    ``temperature == 0``: the argmax. Otherwise a draw from ``softmax(logits / temperature)``
    restricted to the ``top_k`` most likely tokens (ties with the k-th kept; 0: all), then to the
    smallest set of most likely tokens whose probability reaches ``top_p`` (the most likely token
    always stays), drawn with ``generator``: the order in which ``transformers`` applies them."""
    if temperature == 0:
        return greedy_tokens(logits)
    probs = (logits.float() / temperature).softmax(-1)
    if 0 < top_k < probs.shape[-1]:
        probs = probs * (probs >= probs.topk(top_k, -1).values[:, -1:])
        probs = probs / probs.sum(-1, keepdim=True)
    if top_p >= 1:
        return torch.multinomial(probs, 1, generator=generator)[:, 0]
    sorted_p, order = probs.sort(-1, descending=True)
    before = sorted_p.cumsum(-1) - sorted_p  # mass of the tokens ranked above each one
    kept = sorted_p * (before < top_p)
    return order.gather(-1, torch.multinomial(kept, 1, generator=generator))[:, 0]
