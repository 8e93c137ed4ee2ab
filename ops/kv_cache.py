"""Cache writes and reads: ``dsv4::store_kv``, ``dsv4::dequant_kv``, ``dsv4::store_index_k``.

``store_kv`` and ``dequant_kv`` are a fixed public contract (names and argument order).

Shape legend: N = rows, P = page size, Nb = bytes per page.
"""

from __future__ import annotations

import torch

from .. import layout
from ..config import HEAD_DIM, INDEX_HEAD_DIM
from ..reference import kv_store as ref
from ._checks import SLOT_DTYPES, check_same_rows, check_tensor
from ._cuda import HAS_TRITON, cuda_kernel

if HAS_TRITON:
    from .kernels import kv_cache as kernels


def check_model1_cache(op: str, name: str, cache: torch.Tensor, page_size: int) -> None:
    check_tensor(op, name, cache, dtypes=(torch.uint8,), ndim=2)
    want = layout.model1_page_bytes(page_size)
    if cache.shape[1] != want:
        raise ValueError(f"dsv4.{op}: page_size={page_size} does not match {name}: pages of "
                         f"{cache.shape[1]} bytes, a MODEL1 page of {page_size} tokens has {want}")


def _check_store_kv(cache, slots, k, page_size) -> None:
    check_model1_cache("store_kv", "cache", cache, page_size)
    check_tensor("store_kv", "slots", slots, dtypes=SLOT_DTYPES, ndim=1)
    check_tensor("store_kv", "k", k, dtypes=(torch.bfloat16,), ndim=2, shape=(None, HEAD_DIM))
    check_same_rows("store_kv", slots=slots, k=k)


@torch.library.custom_op("dsv4::store_kv", mutates_args=("cache",))
def store_kv(cache: torch.Tensor, slots: torch.Tensor, k: torch.Tensor, page_size: int) -> None:
    """Quantise ``k [N, 512] bf16`` to MODEL1 and write row n at slot ``slots[n]`` of
    ``cache [N_pages, Nb] uint8``; rows with negative slots are skipped."""
    _check_store_kv(cache, slots, k, page_size)
    ref.store_model1(cache, slots, k, page_size)


@cuda_kernel(store_kv)
def _(cache, slots, k, page_size) -> None:
    _check_store_kv(cache, slots, k, page_size)
    kernels.launch_store_kv(cache, slots, k, page_size)


@store_kv.register_fake
def _(cache, slots, k, page_size) -> None:
    _check_store_kv(cache, slots, k, page_size)


def _check_dequant_kv(cache, slots, page_size) -> None:
    check_model1_cache("dequant_kv", "cache", cache, page_size)
    check_tensor("dequant_kv", "slots", slots, dtypes=SLOT_DTYPES, ndim=1)


@torch.library.custom_op("dsv4::dequant_kv", mutates_args=())
def dequant_kv(cache: torch.Tensor, slots: torch.Tensor, page_size: int) -> torch.Tensor:
    """Read back ``[N, 512] bf16`` keys at ``slots [N]`` (zeros for negative slots)."""
    _check_dequant_kv(cache, slots, page_size)
    return ref.gather_model1(cache, slots, page_size).to(torch.bfloat16)


@cuda_kernel(dequant_kv)
def _(cache, slots, page_size):
    _check_dequant_kv(cache, slots, page_size)
    return kernels.launch_dequant_kv(cache, slots, page_size)


@dequant_kv.register_fake
def _(cache, slots, page_size):
    _check_dequant_kv(cache, slots, page_size)
    return cache.new_empty(slots.shape[0], HEAD_DIM, dtype=torch.bfloat16)


def _check_store_index_k(cache, slots, k, page_size) -> None:
    check_tensor("store_index_k", "cache", cache, dtypes=(torch.uint8,), ndim=2,
                 shape=(None, layout.index_page_bytes(page_size)))
    check_tensor("store_index_k", "slots", slots, dtypes=SLOT_DTYPES, ndim=1)
    check_tensor("store_index_k", "k", k, dtypes=(torch.bfloat16, torch.float32), ndim=2,
                 shape=(None, INDEX_HEAD_DIM))
    check_same_rows("store_index_k", slots=slots, k=k)


@torch.library.custom_op("dsv4::store_index_k", mutates_args=("cache",))
def store_index_k(cache: torch.Tensor, slots: torch.Tensor, k: torch.Tensor, page_size: int) -> None:
    """Quantise indexer keys ``k [N, 128]`` (fp8 + fp32 scale per entry) and write row n at
    ``slots[n]`` of ``cache [N_pages, P * 132] uint8``; negative slots are skipped."""
    _check_store_index_k(cache, slots, k, page_size)
    ref.store_index_k(cache, slots, k, page_size)


@cuda_kernel(store_index_k)
def _(cache, slots, k, page_size) -> None:
    _check_store_index_k(cache, slots, k, page_size)
    kernels.launch_store_index_k(cache, slots, k, page_size)


@store_index_k.register_fake
def _(cache, slots, k, page_size) -> None:
    _check_store_index_k(cache, slots, k, page_size)
