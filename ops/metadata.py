"""Per-step metadata ops (SPEC §3): pure functions of the step tensors and the cache index maps.

Every output shape is fixed by ``T = out_cache_loc.shape[0]`` and by cache capacity
(``L_max = req_to_token.shape[1]``), so a step traces to one graph for any lengths.

Shape legend: B = requests, T = query rows, R = request rows, L_max = tokens per request,
NP = L_max // 256, W = 128 (SWA window).
"""

from __future__ import annotations

import torch

from ..config import INDEX_ALIGN, PAGE_SIZE, SWA_WINDOW
from ..reference import metadata as ref
from ._checks import INDEX_DTYPES, check_multiple_of, check_same_rows, check_tensor
from ._cuda import HAS_TRITON, cuda_kernel

if HAS_TRITON:
    from .kernels import metadata as kernels

_I32 = torch.int32


def _check_rows(op: str, **tensors: torch.Tensor) -> None:
    for name, t in tensors.items():
        check_tensor(op, name, t, dtypes=INDEX_DTYPES, ndim=1)
    check_same_rows(op, **tensors)


def _check_req_to_token(op: str, req_to_token: torch.Tensor) -> None:
    check_tensor(op, "req_to_token", req_to_token, dtypes=INDEX_DTYPES, ndim=2)
    check_multiple_of(op, "req_to_token.shape[1]", req_to_token.shape[1], PAGE_SIZE)


# -- expand_queries ----------------------------------------------------------------------------
def _check_expand(req_rows, seq_lens, extend_lens, out_cache_loc) -> None:
    _check_rows("expand_queries", req_rows=req_rows, seq_lens=seq_lens, extend_lens=extend_lens)
    check_tensor("expand_queries", "out_cache_loc", out_cache_loc, dtypes=INDEX_DTYPES, ndim=1)


@torch.library.custom_op("dsv4::expand_queries", mutates_args=())
def expand_queries(req_rows: torch.Tensor, seq_lens: torch.Tensor, extend_lens: torch.Tensor,
                   out_cache_loc: torch.Tensor
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """One row per query token: ``(req_of_row, seq_lens_causal, extend_start, extend_end)`` int32 [T],
    ``T = out_cache_loc.shape[0]``; rows past ``sum(extend_lens)`` are padding (request 0, seq 1)."""
    _check_expand(req_rows, seq_lens, extend_lens, out_cache_loc)
    return ref.expand_queries(req_rows, seq_lens, extend_lens, out_cache_loc.shape[0])


@cuda_kernel(expand_queries)
def _(req_rows, seq_lens, extend_lens, out_cache_loc):
    _check_expand(req_rows, seq_lens, extend_lens, out_cache_loc)
    return kernels.launch_expand_queries(req_rows, seq_lens, extend_lens, out_cache_loc.shape[0])


@expand_queries.register_fake
def _(req_rows, seq_lens, extend_lens, out_cache_loc):
    _check_expand(req_rows, seq_lens, extend_lens, out_cache_loc)
    t = out_cache_loc.shape[0]
    return tuple(out_cache_loc.new_empty(t, dtype=_I32) for _ in range(4))


# -- build_page_table --------------------------------------------------------------------------
def _check_req_to_page(op: str, req_to_page: torch.Tensor) -> None:
    check_tensor(op, "req_to_page", req_to_page, dtypes=INDEX_DTYPES, ndim=2)


def _check_page_table(req_to_page, req_of_row, seq_lens_causal) -> None:
    _check_req_to_page("build_page_table", req_to_page)
    _check_rows("build_page_table", req_of_row=req_of_row, seq_lens_causal=seq_lens_causal)


@torch.library.custom_op("dsv4::build_page_table", mutates_args=())
def build_page_table(req_to_page: torch.Tensor, req_of_row: torch.Tensor,
                     seq_lens_causal: torch.Tensor) -> torch.Tensor:
    """``[T, NP] int32``: full-pool page of each live 256-token page of the row's request, 0 after
    (``req_to_page [R, NP]``: the cache's compact page map)."""
    _check_page_table(req_to_page, req_of_row, seq_lens_causal)
    return ref.build_page_table(req_to_page, req_of_row, seq_lens_causal)


@cuda_kernel(build_page_table)
def _(req_to_page, req_of_row, seq_lens_causal):
    _check_page_table(req_to_page, req_of_row, seq_lens_causal)
    return kernels.launch_build_page_table(req_to_page, req_of_row, seq_lens_causal)


@build_page_table.register_fake
def _(req_to_page, req_of_row, seq_lens_causal):
    _check_page_table(req_to_page, req_of_row, seq_lens_causal)
    return req_of_row.new_empty(req_of_row.shape[0], req_to_page.shape[1], dtype=_I32)


# -- build_swa_metadata ------------------------------------------------------------------------
def _check_swa(req_to_token, full_to_swa, req_of_row, seq_lens_causal, out_cache_loc) -> None:
    _check_req_to_token("build_swa_metadata", req_to_token)
    check_tensor("build_swa_metadata", "full_to_swa", full_to_swa, dtypes=INDEX_DTYPES, ndim=1)
    _check_rows("build_swa_metadata", req_of_row=req_of_row, seq_lens_causal=seq_lens_causal,
                out_cache_loc=out_cache_loc)


@torch.library.custom_op("dsv4::build_swa_metadata", mutates_args=())
def build_swa_metadata(req_to_token: torch.Tensor, full_to_swa: torch.Tensor, req_of_row: torch.Tensor,
                       seq_lens_causal: torch.Tensor, out_cache_loc: torch.Tensor
                       ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(swa_indices [T, 128], swa_lengths [T], swa_out_loc [T])`` int32: window slots newest
    first (-1 before position 0), ``min(pos + 1, 128)``, and the SWA slot each row writes."""
    _check_swa(req_to_token, full_to_swa, req_of_row, seq_lens_causal, out_cache_loc)
    return ref.build_swa_metadata(req_to_token, full_to_swa, req_of_row, seq_lens_causal, out_cache_loc)


@cuda_kernel(build_swa_metadata)
def _(req_to_token, full_to_swa, req_of_row, seq_lens_causal, out_cache_loc):
    _check_swa(req_to_token, full_to_swa, req_of_row, seq_lens_causal, out_cache_loc)
    return kernels.launch_build_swa_metadata(req_to_token, full_to_swa, req_of_row, seq_lens_causal,
                                             out_cache_loc)


@build_swa_metadata.register_fake
def _(req_to_token, full_to_swa, req_of_row, seq_lens_causal, out_cache_loc):
    _check_swa(req_to_token, full_to_swa, req_of_row, seq_lens_causal, out_cache_loc)
    t = req_of_row.shape[0]
    return (req_of_row.new_empty(t, SWA_WINDOW, dtype=_I32), req_of_row.new_empty(t, dtype=_I32),
            req_of_row.new_empty(t, dtype=_I32))


# -- build_c4_metadata -------------------------------------------------------------------------
def _check_c4(seq_lens_causal, out_cache_loc, topk) -> None:
    _check_rows("build_c4_metadata", seq_lens_causal=seq_lens_causal, out_cache_loc=out_cache_loc)
    if topk <= 0:
        raise ValueError(f"dsv4.build_c4_metadata: topk={topk} must be positive")


@torch.library.custom_op("dsv4::build_c4_metadata", mutates_args=())
def build_c4_metadata(seq_lens_causal: torch.Tensor, out_cache_loc: torch.Tensor, topk: int
                      ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(c4_out_loc, c4_visible, c4_topk_lengths)`` int32 [T] (SPEC §3.5-3.6; -1 out slot for
    rows that complete no window)."""
    _check_c4(seq_lens_causal, out_cache_loc, topk)
    return ref.build_c4_metadata(seq_lens_causal, out_cache_loc, topk)


@cuda_kernel(build_c4_metadata)
def _(seq_lens_causal, out_cache_loc, topk):
    _check_c4(seq_lens_causal, out_cache_loc, topk)
    return kernels.launch_build_c4_metadata(seq_lens_causal, out_cache_loc, topk)


@build_c4_metadata.register_fake
def _(seq_lens_causal, out_cache_loc, topk):
    _check_c4(seq_lens_causal, out_cache_loc, topk)
    return tuple(seq_lens_causal.new_empty(seq_lens_causal.shape[0], dtype=_I32) for _ in range(3))


# -- build_c128_metadata -----------------------------------------------------------------------
def _check_c128(page_table, seq_lens_causal, out_cache_loc) -> None:
    check_tensor("build_c128_metadata", "page_table", page_table, dtypes=INDEX_DTYPES, ndim=2)
    _check_rows("build_c128_metadata", seq_lens_causal=seq_lens_causal, out_cache_loc=out_cache_loc)
    check_same_rows("build_c128_metadata", page_table=page_table, seq_lens_causal=seq_lens_causal)


@torch.library.custom_op("dsv4::build_c128_metadata", mutates_args=())
def build_c128_metadata(page_table: torch.Tensor, seq_lens_causal: torch.Tensor,
                        out_cache_loc: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(c128_out_loc [T], c128_indices [T, ceil64(2 NP)], c128_lengths [T])`` int32 (SPEC §3.5)."""
    _check_c128(page_table, seq_lens_causal, out_cache_loc)
    return ref.build_c128_metadata(page_table, seq_lens_causal, out_cache_loc)


@cuda_kernel(build_c128_metadata)
def _(page_table, seq_lens_causal, out_cache_loc):
    _check_c128(page_table, seq_lens_causal, out_cache_loc)
    return kernels.launch_build_c128_metadata(page_table, seq_lens_causal, out_cache_loc)


@build_c128_metadata.register_fake
def _(page_table, seq_lens_causal, out_cache_loc):
    _check_c128(page_table, seq_lens_causal, out_cache_loc)
    t = seq_lens_causal.shape[0]
    width = ref.ceil_to(2 * page_table.shape[1], INDEX_ALIGN)
    return (seq_lens_causal.new_empty(t, dtype=_I32), seq_lens_causal.new_empty(t, width, dtype=_I32),
            seq_lens_causal.new_empty(t, dtype=_I32))


# -- step_metadata: every op above in one launch --------------------------------------------------
def _check_step(req_rows, seq_lens, extend_lens, out_cache_loc, req_to_token, req_to_page, full_to_swa,
                topk) -> None:
    _check_rows("step_metadata", req_rows=req_rows, seq_lens=seq_lens, extend_lens=extend_lens)
    check_tensor("step_metadata", "out_cache_loc", out_cache_loc, dtypes=INDEX_DTYPES, ndim=1)
    _check_req_to_token("step_metadata", req_to_token)
    _check_req_to_page("step_metadata", req_to_page)
    check_tensor("step_metadata", "req_to_page", req_to_page,
                 shape=(req_to_token.shape[0], req_to_token.shape[1] // PAGE_SIZE))
    check_tensor("step_metadata", "full_to_swa", full_to_swa, dtypes=INDEX_DTYPES, ndim=1)
    if topk <= 0:
        raise ValueError(f"dsv4.step_metadata: topk={topk} must be positive")


@torch.library.custom_op("dsv4::step_metadata", mutates_args=())
def step_metadata(req_rows: torch.Tensor, seq_lens: torch.Tensor, extend_lens: torch.Tensor,
                  out_cache_loc: torch.Tensor, req_to_token: torch.Tensor, req_to_page: torch.Tensor,
                  full_to_swa: torch.Tensor, topk: int
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor,
                             torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor,
                             torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The outputs of ``expand_queries``, ``build_page_table``, ``build_swa_metadata``,
    ``build_c4_metadata`` and ``build_c128_metadata``, in that order (14 int32 tensors, equal to the
    separate ops'); on CUDA one launch instead of five."""
    _check_step(req_rows, seq_lens, extend_lens, out_cache_loc, req_to_token, req_to_page, full_to_swa, topk)
    return ref.step_metadata(req_rows, seq_lens, extend_lens, out_cache_loc, req_to_token, req_to_page,
                             full_to_swa, topk)


@cuda_kernel(step_metadata)
def _(req_rows, seq_lens, extend_lens, out_cache_loc, req_to_token, req_to_page, full_to_swa, topk):
    _check_step(req_rows, seq_lens, extend_lens, out_cache_loc, req_to_token, req_to_page, full_to_swa, topk)
    return kernels.launch_step_metadata(req_rows, seq_lens, extend_lens, out_cache_loc, req_to_token,
                                        req_to_page, full_to_swa, topk)


@step_metadata.register_fake
def _(req_rows, seq_lens, extend_lens, out_cache_loc, req_to_token, req_to_page, full_to_swa, topk):
    _check_step(req_rows, seq_lens, extend_lens, out_cache_loc, req_to_token, req_to_page, full_to_swa, topk)
    t, n_pages = out_cache_loc.shape[0], req_to_page.shape[1]
    width = ref.ceil_to(2 * n_pages, INDEX_ALIGN)
    shapes = [(t,)] * 4 + [(t, n_pages), (t, SWA_WINDOW)] + [(t,)] * 6 + [(t, width), (t,)]
    return tuple(out_cache_loc.new_empty(shape, dtype=_I32) for shape in shapes)
