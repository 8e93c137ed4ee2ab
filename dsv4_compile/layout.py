"""The one home of the FP8 cache byte layouts (docs/semantics.md §2.2, §2.3).

MODEL1 token pack (attention caches: SWA, c4, c128), 584 bytes of content per token::

    448 x fp8_e4m3 nope  |  64 x bf16 rope  |  7 x ue8m0 scale  |  1 pad

A page of ``P`` tokens stores the data of all tokens first, then all scales::

    [0, P*576)         token i at [576*i, 576*i+448): nope fp8; [576*i+448, 576*i+576): rope bf16
    [P*576, P*584)     token i at [P*576 + 8*i, +7): scale bytes; byte +7 is padding
    [P*584, padded)    zero padding up to a multiple of 576 bytes

This is FlashMLA's "V4" format byte for byte, so a cache written here is readable by FlashMLA
through a ``[num_pages, P, 1, 584]`` view whose ``stride(0)`` is the padded page size.

Indexer key pack (c4 layers), page of 64 entries::

    [0, 64*128)        entry i at [128*i, +128): fp8_e4m3
    [64*128, 64*132)   entry i at [8192 + 4*i, +4): fp32 scale

Slot -> (page, offset) = (slot // P, slot % P) for both.
"""

from __future__ import annotations

from dataclasses import dataclass

from .config import INDEX_HEAD_DIM, NOPE_DIM, PAGE_SIZE, ROPE_DIM

# -- MODEL1 (attention) token pack -------------------------------------------------------------
FP8_TILE = 64  # nope elements sharing one ue8m0 scale
NUM_TILES = NOPE_DIM // FP8_TILE  # 7
FP8_MAX = 448.0  # largest finite float8_e4m3fn
MODEL1_SCALE_EPS = 1e-4  # amax floor before the power-of-two scale (FlashMLA / fused store)
UE8M0_BIAS = 127
TOKEN_DATA_BYTES = NOPE_DIM + 2 * ROPE_DIM  # 576: nope fp8 + rope bf16
TOKEN_SCALE_BYTES = NUM_TILES + 1  # 8: seven scales + one pad byte
TOKEN_BYTES = TOKEN_DATA_BYTES + TOKEN_SCALE_BYTES  # 584

# -- indexer key pack --------------------------------------------------------------------------
INDEX_PAGE_SIZE = 64
INDEX_ENTRY_BYTES = INDEX_HEAD_DIM + 4  # 132: fp8 values + fp32 scale
INDEX_SCALE_EPS = 1e-4

# -- pool page sizes (entries per page, docs/semantics.md §1.1) ---------------------------------------------
SWA_PAGE_SIZE = PAGE_SIZE
C4_PAGE_SIZE = PAGE_SIZE // 4  # 64
C128_PAGE_SIZE = PAGE_SIZE // 128  # 2


def model1_page_bytes(page_size: int) -> int:
    """Padded bytes of one MODEL1 page: ``ceil(P*584 / 576) * 576`` (256 -> 149760, 64 -> 37440,
    2 -> 1728)."""
    _check_page_size(page_size)
    return -(-page_size * TOKEN_BYTES // TOKEN_DATA_BYTES) * TOKEN_DATA_BYTES


def index_page_bytes(page_size: int = INDEX_PAGE_SIZE) -> int:
    """Bytes of one indexer key page: ``P * 132`` (64 -> 8448)."""
    _check_page_size(page_size)
    return page_size * INDEX_ENTRY_BYTES


@dataclass(frozen=True)
class Model1Offsets:
    """Byte offsets, within its page, of one token's fields (token ``i`` of a page of ``P``)."""

    nope: int  # 448 fp8
    rope: int  # 64 bf16
    scales: int  # 7 ue8m0 (+1 pad)


def model1_offsets(page_size: int, token_in_page: int) -> Model1Offsets:
    data = TOKEN_DATA_BYTES * token_in_page
    return Model1Offsets(nope=data, rope=data + NOPE_DIM,
                         scales=page_size * TOKEN_DATA_BYTES + TOKEN_SCALE_BYTES * token_in_page)


def _check_page_size(page_size: int) -> None:
    if not isinstance(page_size, int) or page_size <= 0:
        raise ValueError(f"page_size must be a positive int, got {page_size!r}")
