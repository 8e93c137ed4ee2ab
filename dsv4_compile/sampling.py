"""Next-token choice on the device: greedy, or temperature / top-p (nucleus) sampling."""

from __future__ import annotations

import torch
import torch.nn.functional as F

# One argmax over a whole vocabulary row runs as one thread block (36 µs for 129,280 bf16 logits on
# the H200, a greedy decode step's largest kernel after the GEMMs); the maxima of chunks of this
# many logits come from a block each, and the argmax over them is short.
GREEDY_CHUNK = 1024


def greedy_tokens(logits: torch.Tensor) -> torch.Tensor:
    """``logits [m, vocab]`` -> ``[m] int64``: ``logits.argmax(-1)`` (the first of equal maxima;
    a NaN counts as the maximum), computed as the argmax of per-chunk maxima."""
    m, vocab = logits.shape
    chunks = -(-vocab // GREEDY_CHUNK)
    padded = F.pad(logits, (0, chunks * GREEDY_CHUNK - vocab), value=float("-inf"))  # after every real logit
    values, within = padded.view(m, chunks, GREEDY_CHUNK).max(-1)  # first maximum of each chunk
    chunk = values.argmax(-1, keepdim=True)  # first chunk holding the row's maximum
    return (chunk * GREEDY_CHUNK + within.gather(-1, chunk))[:, 0]


def check_sampling(temperature: float, top_p: float) -> tuple[float, float]:
    """``(temperature, top_p)`` as floats; ``temperature >= 0`` (0: greedy) and ``0 < top_p <= 1``."""
    for name, value in (("temperature", temperature), ("top_p", top_p)):
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise TypeError(f"{name} must be a number, got {type(value).__name__}")
    if not temperature >= 0:
        raise ValueError(f"temperature={temperature} must be >= 0 (0: greedy)")
    if not 0 < top_p <= 1:
        raise ValueError(f"top_p={top_p} must lie in (0, 1]")
    return float(temperature), float(top_p)


def sample_tokens(logits: torch.Tensor, temperature: float, top_p: float,
                  generator: torch.Generator | None) -> torch.Tensor:
    """One token per row of ``logits [m, vocab]`` -> ``[m] int64``, on the logits' device.

    ``temperature == 0``: the argmax. Otherwise a draw from ``softmax(logits / temperature)``
    restricted to the smallest set of most likely tokens whose probability reaches ``top_p`` (the
    most likely token always stays), drawn with ``generator``."""
    if temperature == 0:
        return greedy_tokens(logits)
    probs = (logits.float() / temperature).softmax(-1)
    if top_p >= 1:
        return torch.multinomial(probs, 1, generator=generator)[:, 0]
    sorted_p, order = probs.sort(-1, descending=True)
    before = sorted_p.cumsum(-1) - sorted_p  # mass of the tokens ranked above each one
    kept = sorted_p * (before < top_p)
    return order.gather(-1, torch.multinomial(kept, 1, generator=generator))[:, 0]
