"""FP8 quantisation of cache entries and paged byte addressing (docs/semantics.md §2.2, §2.3) — reference.

MODEL1 (attention caches), per 64-wide nope tile ``g`` of a key ``k [512]``::

    s_g   = 2 ** ceil(log2(max(amax_g, 1e-4) / 448))          # power of two, ue8m0 byte log2(s)+127
    fp8_g = e4m3(clamp(k_g / s_g, -448, 448))
    rope  = k[448:512] kept as bf16

Indexer keys, per entry ``v [128]``::

    sigma = max(amax, 1e-4) / 448                              # plain fp32 scale
    fp8   = e4m3(clamp(v / sigma, -448, 448))

Shape legend: N = rows, P = page size (entries per page), Nb = bytes per page.
"""

from __future__ import annotations

import torch

from .. import layout
from ..config import INDEX_HEAD_DIM, NOPE_DIM

_FP8 = torch.float8_e4m3fn


def div_fp8_max(x: torch.Tensor) -> torch.Tensor:
    """``x / 448`` as a true IEEE division on every device (CUDA turns a division by a Python
    scalar into a multiplication by its rounded reciprocal, which differs in the last bit)."""
    return x / torch.full_like(x, layout.FP8_MAX)


def ceil_log2(x: torch.Tensor) -> torch.Tensor:
    """Exact ``ceil(log2(x))`` for positive normal fp32 ``x``, from the float's bits (int32)."""
    bits = x.float().view(torch.int32)
    exponent = (bits >> 23) - 127
    return exponent + ((bits & 0x7FFFFF) != 0).to(torch.int32)


def quantize_model1(k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Pack keys into MODEL1 token bytes.

    k: [N, 512] bf16. Returns ``data [N, 576] uint8`` (448 fp8 nope + 64 bf16 rope) and
    ``scales [N, 8] uint8`` (7 ue8m0 exponents + one zero pad byte).
    """
    n = k.shape[0]
    nope = k[:, :NOPE_DIM].float().reshape(n, layout.NUM_TILES, layout.FP8_TILE)  # [N, 7, 64]
    amax = nope.abs().amax(dim=-1).clamp_min(layout.MODEL1_SCALE_EPS)  # [N, 7]
    exponent = ceil_log2(div_fp8_max(amax))  # [N, 7] int32
    inv_scale = torch.exp2(-exponent.float()).unsqueeze(-1)  # exact power of two
    fp8 = (nope * inv_scale).clamp(-layout.FP8_MAX, layout.FP8_MAX).to(_FP8).reshape(n, NOPE_DIM)
    rope = k[:, NOPE_DIM:].to(torch.bfloat16).contiguous()
    data = torch.cat([fp8.view(torch.uint8), rope.view(torch.uint8)], dim=1)  # [N, 576]
    scales = torch.cat([(exponent + layout.UE8M0_BIAS).to(torch.uint8),
                        torch.zeros(n, 1, dtype=torch.uint8, device=k.device)], dim=1)
    return data, scales


def dequantize_model1(data: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`quantize_model1`: ``[N, 576] u8, [N, 8] u8 -> [N, 512] fp32`` (exact)."""
    n = data.shape[0]
    nope = data[:, :NOPE_DIM].contiguous().view(_FP8).float().reshape(n, layout.NUM_TILES, layout.FP8_TILE)
    scale = torch.exp2(scales[:, : layout.NUM_TILES].float() - layout.UE8M0_BIAS).unsqueeze(-1)
    rope = data[:, NOPE_DIM:].contiguous().view(torch.bfloat16).float()
    return torch.cat([(nope * scale).reshape(n, NOPE_DIM), rope], dim=1)


def fake_quant_model1(k: torch.Tensor) -> torch.Tensor:
    """What a MODEL1 cache returns for ``k [N, 512]``: quantise then dequantise (bf16, exact)."""
    return dequantize_model1(*quantize_model1(k)).to(torch.bfloat16)


def model1_page_views(cache: torch.Tensor, page_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Views of a MODEL1 cache ``[N_pages, Nb] uint8``: token data ``[N_pages, P, 576]`` and
    token scales ``[N_pages, P, 8]`` (both alias the cache; writes go through)."""
    data_end = page_size * layout.TOKEN_DATA_BYTES
    data = cache[:, :data_end].unflatten(1, (page_size, layout.TOKEN_DATA_BYTES))
    scales = cache[:, data_end:data_end + page_size * layout.TOKEN_SCALE_BYTES].unflatten(
        1, (page_size, layout.TOKEN_SCALE_BYTES))
    return data, scales


def quantize_index_k(k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Indexer key pack: ``k [N, 128] -> (fp8 bytes [N, 128] uint8, scale [N] fp32)``."""
    v = k.float()
    sigma = div_fp8_max(v.abs().amax(dim=-1).clamp_min(layout.INDEX_SCALE_EPS))  # [N]
    fp8 = (v / sigma.unsqueeze(1)).clamp(-layout.FP8_MAX, layout.FP8_MAX).to(_FP8)
    return fp8.view(torch.uint8), sigma


def dequantize_index_k(vals: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`quantize_index_k`: ``[N, 128] u8, [N] fp32 -> [N, 128] fp32``."""
    return vals.contiguous().view(_FP8).float() * scale.unsqueeze(1)


def fake_quant_index_k(k: torch.Tensor) -> torch.Tensor:
    """What the indexer key cache returns for ``k [N, 128]`` (fp32)."""
    return dequantize_index_k(*quantize_index_k(k))


def index_page_views(cache: torch.Tensor, page_size: int = layout.INDEX_PAGE_SIZE
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """Views of an indexer key cache ``[N_pages, P * 132] uint8``: fp8 values
    ``[N_pages, P, 128] uint8`` and scales ``[N_pages, P] fp32`` (both alias the cache)."""
    vals_end = page_size * INDEX_HEAD_DIM
    vals = cache[:, :vals_end].unflatten(1, (page_size, INDEX_HEAD_DIM))
    scales = cache[:, vals_end:vals_end + 4 * page_size].view(torch.float32)
    return vals, scales


def quantize_q_per_head(q: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Indexer query quantisation per (row, head) (docs/semantics.md §4.3 step 2).

    q: [T, H, 128] fp32. Returns ``q_fp8 [T, H, 128] float8_e4m3fn`` and ``sigma [T, H] fp32``.
    """
    sigma = div_fp8_max(q.abs().amax(dim=-1).clamp_min(layout.INDEX_SCALE_EPS))
    q_fp8 = (q / sigma.unsqueeze(-1)).clamp(-layout.FP8_MAX, layout.FP8_MAX).to(_FP8)
    return q_fp8, sigma
