"""``dsv4::compress_kv``: softmax-gated window pooling + RMSNorm + RoPE (+ Hadamard) with the
compressor state ring (docs/semantics.md §4.2). The caller stores the result with ``store_kv``
(attention compressor) or ``store_index_k`` (indexer compressor) at the c4 / c128 out slots.
``dsv4::compress_kv_store`` is the two in one op: on CUDA the entry kernel quantises and writes
each entry itself (one launch less a compressor; a compiled step gets it from
``FuseEntryStorePass``).

Out of range (docs/semantics.md §6): a row whose request row is outside ``[0, R)``
(``R = state rows / ring``) or whose position is negative reads no ring row (those slots weigh 0,
as slots before position 0 do) and writes none; masked slots never reach the output, whatever
their ring rows hold (NaN included).

Shape legend: T = rows, d = entry dim (512 or 128), Wc = coff * d (coff 2 for ratio 4, else 1),
R = request rows, ring = state rows per request.
"""

from __future__ import annotations

import torch

from ..config import HEAD_DIM, INDEX_HEAD_DIM, ROPE_DIM
from ..reference import compressor as ref
from ..reference import kv_store
from ._checks import INDEX_DTYPES, SLOT_DTYPES, check_devices, check_non_negative, check_same_rows, check_tensor
from ._library import HAS_TRITON, dsv4_op
from .kv_cache import check_index_cache, check_model1_cache, writes_only

if HAS_TRITON:
    from .kernels import compressor as kernels

_F32 = (torch.float32,)
# kv / score straight from their projections, or already widened
_PROJECTION_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _check_compress_kv(*args, **kwargs) -> None:
    _check_compression("compress_kv", *args, **kwargs)


def _check_compression(op: str, state, kv, score, ape, req_of_row, seq_lens_causal, extend_start, extend_end,
                       norm_weight, inv_freq, ratio, ring, rotate, eps) -> None:
    """``compress_kv``'s arguments, checked for ``op``."""
    check_devices(op, state=state, kv=kv, score=score, ape=ape, req_of_row=req_of_row, seq_lens_causal=seq_lens_causal,
                  extend_start=extend_start, extend_end=extend_end, norm_weight=norm_weight, inv_freq=inv_freq)
    if ratio not in (4, 128):
        raise ValueError(f"dsv4.{op}: ratio={ratio} must be 4 or 128")
    check_tensor(op, "norm_weight", norm_weight, dtypes=_PROJECTION_DTYPES, ndim=1)
    d = norm_weight.shape[0]
    if d not in (HEAD_DIM, INDEX_HEAD_DIM):
        raise ValueError(f"dsv4.{op}: norm_weight has {d} entries: an entry is a MODEL1 key ({HEAD_DIM}) "
                         f"or an indexer key ({INDEX_HEAD_DIM})")
    check_non_negative(op, "eps", eps)
    wc = d * (2 if ratio == 4 else 1)
    check_tensor(op, "kv", kv, dtypes=_PROJECTION_DTYPES, ndim=2, shape=(None, wc))
    check_tensor(op, "score", score, dtypes=_PROJECTION_DTYPES, ndim=2, shape=(None, wc))
    check_tensor(op, "ape", ape, dtypes=_F32, ndim=2, shape=(ratio, wc))
    check_tensor(op, "state", state, dtypes=_F32, ndim=2, shape=(None, 2 * wc))
    check_tensor(op, "inv_freq", inv_freq, dtypes=_F32, ndim=1, shape=(ROPE_DIM // 2,))
    if ring < ref.window_slots(ratio) or state.shape[0] % ring:
        raise ValueError(f"dsv4.{op}: ring={ring} must be >= {ref.window_slots(ratio)} and divide "
                         f"state rows ({state.shape[0]})")
    rows = dict(req_of_row=req_of_row, seq_lens_causal=seq_lens_causal, extend_start=extend_start,
                extend_end=extend_end)
    for name, t in rows.items():
        check_tensor(op, name, t, dtypes=INDEX_DTYPES, ndim=1)
    check_same_rows(op, kv=kv, score=score, **rows)


def _compress_kv_fake(state, kv, score, ape, req_of_row, seq_lens_causal, extend_start, extend_end, norm_weight,
                      *_):
    return kv.new_empty(kv.shape[0], norm_weight.shape[0], dtype=torch.bfloat16)


@dsv4_op("compress_kv", check=_check_compress_kv, fake=_compress_kv_fake,
         cuda=kernels.launch_compress_kv if HAS_TRITON else None, mutates_args=("state",))
def compress_kv(state: torch.Tensor, kv: torch.Tensor, score: torch.Tensor, ape: torch.Tensor,
                req_of_row: torch.Tensor, seq_lens_causal: torch.Tensor, extend_start: torch.Tensor,
                extend_end: torch.Tensor, norm_weight: torch.Tensor, inv_freq: torch.Tensor, ratio: int,
                ring: int, rotate: bool, eps: float) -> torch.Tensor:
    """One potential compressed entry per row, ``[T, d] bf16`` (meaningful where the row
    completes a window), of ``kv`` / ``score`` ``[T, Wc]`` (fp32, or bf16 / fp16 widened exactly to
    fp32); writes this step's projections into ``state [R * ring, 2 Wc] fp32``
    (no ring row for request rows outside ``[0, R)``)."""
    return ref.compress_kv(state, kv, score, ape, req_of_row, seq_lens_causal, extend_start, extend_end,
                           norm_weight, inv_freq, ratio, ring, rotate, eps)


def _check_compress_kv_store(state, cache, slots, kv, score, ape, req_of_row, seq_lens_causal, extend_start,
                             extend_end, norm_weight, inv_freq, ratio, ring, rotate, eps, page_size) -> None:
    op = "compress_kv_store"
    _check_compression(op, state, kv, score, ape, req_of_row, seq_lens_causal, extend_start, extend_end, norm_weight,
                       inv_freq, ratio, ring, rotate, eps)
    check_devices(op, state=state, cache=cache, slots=slots)
    if norm_weight.shape[0] == HEAD_DIM:
        check_model1_cache(op, "cache", cache, page_size)
    else:
        check_index_cache(op, "cache", cache, page_size)
    check_tensor(op, "slots", slots, dtypes=SLOT_DTYPES, ndim=1)
    check_same_rows(op, slots=slots, kv=kv)


@dsv4_op("compress_kv_store", check=_check_compress_kv_store, fake=writes_only,
         cuda=kernels.launch_compress_kv_store if HAS_TRITON else None,
         mutates_args=("state", "cache"), side_stream=True)
def compress_kv_store(state: torch.Tensor, cache: torch.Tensor, slots: torch.Tensor, kv: torch.Tensor,
                      score: torch.Tensor, ape: torch.Tensor, req_of_row: torch.Tensor, seq_lens_causal: torch.Tensor,
                      extend_start: torch.Tensor, extend_end: torch.Tensor, norm_weight: torch.Tensor,
                      inv_freq: torch.Tensor, ratio: int, ring: int, rotate: bool, eps: float, page_size: int) -> None:
    """``compress_kv`` and the write of its entries in one op: row n's entry quantised and written at
    ``slots[n]`` (int32/int64 ``[T]``; outside ``[0, N_pages * P)``: skipped) of ``cache [N_pages,
    Nb] uint8`` as ``store_kv`` writes a ``[T, 512]`` entry (d = 512: a MODEL1 cache of
    ``page_size`` tokens a page) and ``store_index_k`` a ``[T, 128]`` one (d = 128: an indexer
    cache); ``state`` updated as ``compress_kv`` updates it. A row completing no window has an
    unspecified entry (its slot is -1 in a step's metadata)."""
    entries = ref.compress_kv(state, kv, score, ape, req_of_row, seq_lens_causal, extend_start, extend_end,
                              norm_weight, inv_freq, ratio, ring, rotate, eps)
    store = kv_store.store_model1 if norm_weight.shape[0] == HEAD_DIM else kv_store.store_index_k
    store(cache, slots, entries, page_size)
