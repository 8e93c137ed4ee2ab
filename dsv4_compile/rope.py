"""RoPE frequencies per layer, with YaRN for compressed layers (docs/semantics.md §1.2)."""

from __future__ import annotations

import math

import torch

from .config import ROPE_DIM, DSV4AttnConfig


def _correction_dim(num_rotations: float, dim: int, base: float, original_len: int) -> float:
    return dim * math.log(original_len / (num_rotations * 2 * math.pi)) / (2 * math.log(base))


def rope_inv_freq(base: float, *, yarn_factor: float = 1.0, original_len: int = 0,
                  max_len: int = 0, beta_fast: float = 32.0, beta_slow: float = 1.0) -> torch.Tensor:
    """``[ROPE_DIM // 2]`` fp32 inverse frequencies ``base**(-2i/64)``, YaRN-blended when
    ``max_len > original_len > 0``."""
    dim = ROPE_DIM
    base_pow = base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)
    freqs = 1.0 / base_pow
    if original_len > 0 and max_len > original_len:
        lo = max(math.floor(_correction_dim(beta_fast, dim, base, original_len)), 0)
        hi = min(math.ceil(_correction_dim(beta_slow, dim, base, original_len)), dim - 1)
        if lo == hi:
            hi += 0.001
        ramp = ((torch.arange(dim // 2, dtype=torch.float32) - lo) / (hi - lo)).clamp(0, 1)
        smooth = 1 - ramp
        # 1 / (factor * base**(2i/64)) rather than freqs / factor: the two round differently
        # unless the factor is a power of two, and the former is what transformers computes.
        freqs = 1.0 / (yarn_factor * base_pow) * (1 - smooth) + freqs * smooth
    return freqs


def layer_inv_freq(config: DSV4AttnConfig, ratio: int) -> torch.Tensor:
    """The layer's RoPE table: plain ``rope_theta`` for ratio 0, YaRN on ``compress_rope_theta``
    for ratios 4 / 128 (used for q, kv, compressor outputs and the indexer alike)."""
    if ratio == 0:
        return rope_inv_freq(config.rope_theta)
    return rope_inv_freq(config.compress_rope_theta, yarn_factor=config.yarn_factor,
                         original_len=config.yarn_original_max_position,
                         max_len=config.max_position_embeddings,
                         beta_fast=config.yarn_beta_fast, beta_slow=config.yarn_beta_slow)
