"""Cache writes and reads: ``dsv4::store_kv``, ``dsv4::dequant_kv``, ``dsv4::store_index_k``.

``store_kv`` and ``dequant_kv`` are a fixed public contract (names and argument order). A slot is
valid when ``0 <= slot < N_pages * P`` for the cache tensor given (a slice of a larger buffer
included): writes skip every other slot, reads return zeros for it (docs/semantics.md §6).

Shape legend: N = rows, P = page size, Nb = bytes per page.
"""

from __future__ import annotations

import torch

from .. import layout
from ..config import HEAD_DIM, INDEX_HEAD_DIM
from ..reference import kv_store as ref
from ._checks import SLOT_DTYPES, check_devices, check_positive, check_same_rows, check_tensor
from ._library import HAS_TRITON, dsv4_op

if HAS_TRITON:
    from .kernels import kv_cache as kernels


def check_model1_cache(op: str, name: str, cache: torch.Tensor, page_size: int) -> None:
    check_tensor(op, name, cache, dtypes=(torch.uint8,), ndim=2)
    check_positive(op, "page_size", page_size)
    want = layout.model1_page_bytes(page_size)
    if cache.shape[1] != want:
        raise ValueError(f"dsv4.{op}: page_size={page_size} does not match {name}: pages of "
                         f"{cache.shape[1]} bytes, a MODEL1 page of {page_size} tokens has {want}")


def check_index_cache(op: str, name: str, cache: torch.Tensor, page_size: int) -> None:
    """An indexer key cache: ``uint8 [N_pages, P * 132]`` for pages of ``page_size`` keys."""
    check_positive(op, "page_size", page_size)
    check_tensor(op, name, cache, dtypes=(torch.uint8,), ndim=2, shape=(None, layout.index_page_bytes(page_size)))


def _check_slots_and_keys(op: str, slots: torch.Tensor, k: torch.Tensor | None = None,
                k_dtypes: tuple[torch.dtype, ...] = (), k_dim: int = 0) -> None:
    """``slots [N]`` and, for a write, ``k [N, k_dim]`` of one of ``k_dtypes``."""
    check_tensor(op, "slots", slots, dtypes=SLOT_DTYPES, ndim=1)
    if k is not None:
        check_tensor(op, "k", k, dtypes=k_dtypes, ndim=2, shape=(None, k_dim))
        check_same_rows(op, slots=slots, k=k)


def _check_store_kv(cache, slots, k, page_size) -> None:
    check_devices("store_kv", cache=cache, slots=slots, k=k)
    check_model1_cache("store_kv", "cache", cache, page_size)
    _check_slots_and_keys("store_kv", slots, k, (torch.bfloat16,), HEAD_DIM)


def _check_dequant_kv(cache, slots, page_size) -> None:
    check_devices("dequant_kv", cache=cache, slots=slots)
    check_model1_cache("dequant_kv", "cache", cache, page_size)
    _check_slots_and_keys("dequant_kv", slots)


def _check_store_index_k(cache, slots, k, page_size) -> None:
    check_devices("store_index_k", cache=cache, slots=slots, k=k)
    check_index_cache("store_index_k", "cache", cache, page_size)
    _check_slots_and_keys("store_index_k", slots, k, (torch.bfloat16, torch.float32), INDEX_HEAD_DIM)


def writes_only(*_) -> None:
    """Fake of a cache write: no output."""


def _dequant_kv_fake(cache, slots, page_size):
    return cache.new_empty(slots.shape[0], HEAD_DIM, dtype=torch.bfloat16)


@dsv4_op("store_kv", check=_check_store_kv, fake=writes_only,
         cuda=kernels.launch_store_kv if HAS_TRITON else None,
         mutates_args=("cache",), side_stream=True)
def store_kv(cache: torch.Tensor, slots: torch.Tensor, k: torch.Tensor, page_size: int) -> None:
    """Quantise ``k [N, 512] bf16`` to MODEL1 and write row n at slot ``slots[n]`` (int32/int64
    ``[N]``) of ``cache [N_pages, Nb] uint8``; rows whose slot is outside ``[0, N_pages * P)`` are
    skipped."""
    ref.store_model1(cache, slots, k, page_size)


@dsv4_op("dequant_kv", check=_check_dequant_kv, fake=_dequant_kv_fake,
         cuda=kernels.launch_dequant_kv if HAS_TRITON else None)
def dequant_kv(cache: torch.Tensor, slots: torch.Tensor, page_size: int) -> torch.Tensor:
    """Read back ``[N, 512] bf16`` keys at ``slots [N]`` (zeros for slots outside
    ``[0, N_pages * P)``)."""
    return ref.gather_model1(cache, slots, page_size).to(torch.bfloat16)


@dsv4_op("store_index_k", check=_check_store_index_k, fake=writes_only,
         cuda=kernels.launch_store_index_k if HAS_TRITON else None,
         mutates_args=("cache",), side_stream=True)
def store_index_k(cache: torch.Tensor, slots: torch.Tensor, k: torch.Tensor, page_size: int) -> None:
    """Quantise indexer keys ``k [N, 128]`` (fp8 + fp32 scale per entry) and write row n at
    ``slots[n]`` of ``cache [N_pages, P * 132] uint8``; slots outside ``[0, N_pages * P)`` are
    skipped."""
    ref.store_index_k(cache, slots, k, page_size)
