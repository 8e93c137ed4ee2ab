"""Triton kernels for the paged cache writes and reads (docs/semantics.md §2.2, §2.3, §4.1).

``launch_store_kv`` / ``launch_dequant_kv``: MODEL1 token packs (attention caches);
``launch_store_index_k``: indexer key packs. One program per row; byte layouts from ``layout.py``.

Shape legend: N = rows, P = page size (entries per page), Nb = bytes per page.

Exactness: the scale exponent is computed from the float's bits, the scale is an exact power of
two and every division is IEEE round-to-nearest (``div_rn``), so on the GPU the written bytes equal
the reference's bytes. A row whose slot is outside ``[0, N_pages * P)`` (the pages of the tensor
given: negative, or past the end of a slice of a larger buffer) writes nothing and reads zeros:
every store and load is masked (docs/semantics.md §6).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ... import layout
from ...config import HEAD_DIM, INDEX_HEAD_DIM, NOPE_DIM, ROPE_DIM
from .host import INTERPRET
from .primitives import ceil_log2, to_e4m3_bits


@triton.jit
def _slot_page(slots_ptr, row, capacity, PAGE: tl.constexpr):
    """``(valid, page, offset)`` of ``slots[row]``, int64; a slot outside ``[0, capacity)`` maps
    to (0, 0)."""
    slot = tl.load(slots_ptr + row).to(tl.int64)
    valid = (slot >= 0) & (slot < capacity)
    slot = tl.where(valid, slot, 0)
    return valid, slot // PAGE, slot % PAGE


@triton.jit
def model1_slot_ptrs(cache_ptr, slots_ptr, row, capacity, stride_page, PAGE: tl.constexpr,
                     DATA_BYTES: tl.constexpr, SCALE_BYTES: tl.constexpr):
    """``(valid, data_ptr, scale_ptr)`` of the MODEL1 token at ``slots[row]`` (layout.py)."""
    valid, page, off = _slot_page(slots_ptr, row, capacity, PAGE)
    page_ptr = cache_ptr + page * stride_page
    return valid, page_ptr + off * DATA_BYTES, page_ptr + PAGE * DATA_BYTES + off * SCALE_BYTES


@triton.jit
def model1_tiles(TILE: tl.constexpr):
    """``[8, TILE]`` element indices of a key seen as 8 tiles: 7 nope tiles, then the rope."""
    return tl.arange(0, 8)[:, None] * TILE + tl.arange(0, TILE)[None, :]


@triton.jit
def model1_rope_ptr(data_ptr, NOPE: tl.constexpr):
    """The bf16 rope values of a MODEL1 token (its byte offset is even)."""
    return (data_ptr + NOPE).to(tl.pointer_type(tl.bfloat16))


@triton.jit
def store_model1_nope(data_ptr, scale_ptr, x, valid, TILE: tl.constexpr, NUM_TILES: tl.constexpr,
                      FP8_MAX: tl.constexpr, EPS: tl.constexpr, BIAS: tl.constexpr, SOFT_FP8: tl.constexpr):
    """The nope tiles of ``x [8, TILE] fp32`` (a key as :func:`model1_tiles` lays it out; tile 7,
    the rope, is ignored) quantised to FP8 with a power-of-two scale per tile, and the scale
    bytes (byte 7 the zero pad) written at ``data_ptr`` / ``scale_ptr`` if ``valid``."""
    tile = tl.arange(0, 8)
    amax = tl.maximum(tl.max(tl.abs(x), axis=1), EPS)  # [8]
    exponent = ceil_log2(tl.math.div_rn(amax, FP8_MAX))
    is_nope = tile < NUM_TILES
    # 2**-exponent from its bits (exact; the rope tile's value is unused)
    inv_scale = (tl.where(is_nope, 127 - exponent, 127) << 23).to(tl.float32, bitcast=True)
    fp8 = to_e4m3_bits(tl.clamp(x * inv_scale[:, None], -FP8_MAX, FP8_MAX), SOFT_FP8)
    tl.store(data_ptr + model1_tiles(TILE), fp8, mask=is_nope[:, None] & valid)
    tl.store(scale_ptr + tile, tl.where(is_nope, exponent + BIAS, 0).to(tl.uint8), mask=valid)


@triton.jit
def store_model1_key(data_ptr, scale_ptr, x, valid, NOPE: tl.constexpr, TILE: tl.constexpr, NUM_TILES: tl.constexpr,
                     FP8_MAX: tl.constexpr, EPS: tl.constexpr, BIAS: tl.constexpr, SOFT_FP8: tl.constexpr):
    """A whole key ``x [8, TILE] fp32`` holding bf16 values (:func:`model1_tiles`' layout, the rope
    tile last) written as a MODEL1 token at ``data_ptr`` / ``scale_ptr`` if ``valid``: the nope
    tiles by :func:`store_model1_nope`, the rope tile as its bf16 values (exact)."""
    is_rope = tl.arange(0, 8) == NUM_TILES
    store_model1_nope(data_ptr, scale_ptr, x, valid, TILE, NUM_TILES, FP8_MAX, EPS, BIAS, SOFT_FP8)
    tl.store(model1_rope_ptr(data_ptr, NOPE) + (model1_tiles(TILE) - NOPE), x.to(tl.bfloat16),
             mask=is_rope[:, None] & valid)


@triton.jit
def _store_kv_kernel(cache_ptr, slots_ptr, k_ptr, capacity, stride_page, stride_kn, stride_kd,
                     PAGE: tl.constexpr, DATA_BYTES: tl.constexpr, SCALE_BYTES: tl.constexpr,
                     NOPE: tl.constexpr, ROPE: tl.constexpr, TILE: tl.constexpr,
                     NUM_TILES: tl.constexpr, FP8_MAX: tl.constexpr, EPS: tl.constexpr,
                     BIAS: tl.constexpr, SOFT_FP8: tl.constexpr):
    """Row n of ``k [N, 512] bf16`` -> MODEL1 bytes of slot ``slots[n]`` (docs/semantics.md §2.2),
    if that slot is in ``[0, capacity)``."""
    tl.static_assert(NOPE + ROPE == 8 * TILE)  # the key is seen as 8 tiles: 7 nope + rope
    tl.static_assert(SCALE_BYTES == 8)  # 7 scales + the pad byte, one per tile
    tl.static_assert(ROPE == TILE)
    row = tl.program_id(0).to(tl.int64)
    valid, data_ptr, scale_ptr = model1_slot_ptrs(cache_ptr, slots_ptr, row, capacity, stride_page, PAGE,
                                                  DATA_BYTES, SCALE_BYTES)

    x = tl.load(k_ptr + row * stride_kn + model1_tiles(TILE) * stride_kd).to(tl.float32)
    store_model1_key(data_ptr, scale_ptr, x, valid, NOPE, TILE, NUM_TILES, FP8_MAX, EPS, BIAS, SOFT_FP8)


@triton.jit
def _dequant_kv_kernel(out_ptr, cache_ptr, slots_ptr, capacity, stride_page, stride_on,
                       PAGE: tl.constexpr, DATA_BYTES: tl.constexpr, SCALE_BYTES: tl.constexpr,
                       NOPE: tl.constexpr, ROPE: tl.constexpr, TILE: tl.constexpr,
                       NUM_TILES: tl.constexpr, BIAS: tl.constexpr):
    """MODEL1 bytes of slot ``slots[n]`` -> row n of ``out [N, 512] bf16`` (zeros if the slot is
    outside ``[0, capacity)``)."""
    row = tl.program_id(0).to(tl.int64)
    valid, data_ptr, scale_ptr = model1_slot_ptrs(cache_ptr, slots_ptr, row, capacity, stride_page, PAGE,
                                                  DATA_BYTES, SCALE_BYTES)

    tile = tl.arange(0, 8)
    is_nope = tile < NUM_TILES
    col = model1_tiles(TILE)
    # an invalid slot reads nothing: code 0 (+0.0) at scale 1, rope 0
    code = tl.load(data_ptr + col, mask=is_nope[:, None] & valid, other=0)
    e = tl.load(scale_ptr + tile, mask=is_nope & valid, other=BIAS).to(tl.int32)
    # 2**(e - 127) from its bits; e == 0 is the subnormal 2**-127
    scale = tl.where(e == 0, 1 << 22, e << 23).to(tl.float32, bitcast=True)
    nope = code.to(tl.float8e4nv, bitcast=True).to(tl.float32) * scale[:, None]
    # exact in bf16: 4 significant bits times a power of two
    tl.store(out_ptr + row * stride_on + col, nope.to(tl.bfloat16), mask=is_nope[:, None])

    r = tl.arange(0, ROPE)
    rope = tl.load(model1_rope_ptr(data_ptr, NOPE) + r, mask=valid, other=0.0)
    tl.store(out_ptr + row * stride_on + NOPE + r, rope)


@triton.jit
def _store_index_k_kernel(cache_ptr, slots_ptr, k_ptr, capacity, stride_page, stride_kn, stride_kd,
                          PAGE: tl.constexpr, DIM: tl.constexpr, FP8_MAX: tl.constexpr,
                          EPS: tl.constexpr, SOFT_FP8: tl.constexpr):
    """Row n of ``k [N, 128]`` -> fp8 values + fp32 scale of indexer slot ``slots[n]``
    (docs/semantics.md §2.3), if that slot is in ``[0, capacity)``."""
    row = tl.program_id(0).to(tl.int64)
    v = tl.load(k_ptr + row * stride_kn + tl.arange(0, DIM) * stride_kd).to(tl.float32)
    store_index_key(cache_ptr, slots_ptr, row, capacity, stride_page, v, PAGE, DIM, FP8_MAX, EPS, SOFT_FP8)


@triton.jit
def store_index_key(cache_ptr, slots_ptr, row, capacity, stride_page, v, PAGE: tl.constexpr, DIM: tl.constexpr,
                    FP8_MAX: tl.constexpr, EPS: tl.constexpr, SOFT_FP8: tl.constexpr):
    """Indexer key ``v [DIM] fp32`` -> fp8 values + fp32 scale of indexer slot ``slots[row]``
    (docs/semantics.md §2.3), if that slot is in ``[0, capacity)``."""
    valid, page, off = _slot_page(slots_ptr, row, capacity, PAGE)
    page_ptr = cache_ptr + page * stride_page
    sigma = tl.math.div_rn(tl.maximum(tl.max(tl.abs(v), axis=0), EPS), FP8_MAX)
    fp8 = to_e4m3_bits(tl.clamp(tl.math.div_rn(v, sigma), -FP8_MAX, FP8_MAX), SOFT_FP8)
    tl.store(page_ptr + off * DIM + tl.arange(0, DIM), fp8, mask=valid)
    scale_ptr = (page_ptr + PAGE * DIM + off * 4).to(tl.pointer_type(tl.float32))  # 4-aligned
    tl.store(scale_ptr, sigma, mask=valid)


def check_page_rows(op: str, cache: torch.Tensor) -> None:
    if cache.stride(1) != 1:
        raise ValueError(f"dsv4.{op}: cache pages must be contiguous bytes, got strides {cache.stride()}")


def model1_constants() -> dict:
    return dict(DATA_BYTES=layout.TOKEN_DATA_BYTES, SCALE_BYTES=layout.TOKEN_SCALE_BYTES, NOPE=NOPE_DIM,
                ROPE=ROPE_DIM, TILE=layout.FP8_TILE, NUM_TILES=layout.NUM_TILES, BIAS=layout.UE8M0_BIAS)


def model1_store_constants() -> dict:
    """:func:`model1_constants` and the quantisation's constants, for a kernel that writes keys."""
    return dict(**model1_constants(), FP8_MAX=layout.FP8_MAX, EPS=layout.MODEL1_SCALE_EPS, SOFT_FP8=INTERPRET)


def key_store_constants(key_dim: int) -> dict:
    """The constants of a kernel that writes keys of ``key_dim`` elements, MODEL1 tokens (512:
    :func:`store_model1_key`) or indexer keys (128: :func:`store_index_key`), under one set of
    names: :func:`model1_store_constants`, with the indexer's scale floor as ``EPS`` for 128."""
    eps = layout.MODEL1_SCALE_EPS if key_dim == HEAD_DIM else layout.INDEX_SCALE_EPS
    return dict(model1_store_constants(), EPS=eps)


def launch_store_kv(cache: torch.Tensor, slots: torch.Tensor, k: torch.Tensor, page_size: int) -> None:
    """Quantise ``k [N, 512] bf16`` to MODEL1 and write row n at ``slots[n]`` (int32/int64 [N];
    outside ``[0, N_pages * P)``: skipped) of ``cache [N_pages, Nb] uint8`` (pages may be strided,
    bytes contiguous)."""
    check_page_rows("store_kv", cache)
    if k.shape[0] == 0:
        return
    _store_kv_kernel[(k.shape[0],)](
        cache, slots.contiguous(), k, cache.shape[0] * page_size, cache.stride(0), k.stride(0), k.stride(1),
        PAGE=page_size, **model1_store_constants(), num_warps=4)


def launch_dequant_kv(cache: torch.Tensor, slots: torch.Tensor, page_size: int) -> torch.Tensor:
    """Keys at ``slots [N]`` of a MODEL1 cache as ``[N, 512] bf16`` (zeros for slots outside
    ``[0, N_pages * P)``)."""
    check_page_rows("dequant_kv", cache)
    out = torch.empty(slots.shape[0], HEAD_DIM, dtype=torch.bfloat16, device=cache.device)
    if slots.shape[0]:
        _dequant_kv_kernel[(slots.shape[0],)](
            out, cache, slots.contiguous(), cache.shape[0] * page_size, cache.stride(0), out.stride(0), PAGE=page_size,
            **model1_constants(), num_warps=4)
    return out


def launch_store_index_k(cache: torch.Tensor, slots: torch.Tensor, k: torch.Tensor,
                         page_size: int) -> None:
    """Quantise indexer keys ``k [N, 128] bf16/fp32`` (fp8 + fp32 scale per entry) and write row n
    at ``slots[n]`` (outside ``[0, N_pages * P)``: skipped) of ``cache [N_pages, P * 132] uint8``."""
    check_page_rows("store_index_k", cache)
    if k.shape[0] == 0:
        return
    _store_index_k_kernel[(k.shape[0],)](
        cache, slots.contiguous(), k, cache.shape[0] * page_size, cache.stride(0), k.stride(0), k.stride(1),
        PAGE=page_size, DIM=INDEX_HEAD_DIM, FP8_MAX=layout.FP8_MAX, EPS=layout.INDEX_SCALE_EPS, SOFT_FP8=INTERPRET,
        num_warps=1)
