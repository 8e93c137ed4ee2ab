"""Per-step metadata ops (docs/semantics.md §3): pure functions of the step tensors and the cache
index maps.

Every output shape is fixed by ``T = out_cache_loc.shape[0]`` and by cache capacity
(``L_max = req_to_token.shape[1]``), so a step traces to one graph for any lengths. What each op
returns — names, order, dtypes, shapes — is its fields in ``metadata_chain.FIELDS`` (their
formulas: the reference functions): the return annotations (hence the schemas), the fakes and the
kernels' buffers all come from there. This module has no ``from __future__ import annotations``:
a schema is inferred from the annotation objects, which are computed from that table.

Out-of-range values read as "no entry" (docs/semantics.md §6): a request row outside
``[0, R)`` has no pages (0) and no window (-1) and writes nothing; a position past ``L_max`` or
a full slot outside ``full_to_swa`` has no SWA slot (-1); a negative out slot, like a request row
outside ``[0, R)``, gives -1 in ``swa_out_loc``, ``c4_out_loc`` and ``c128_out_loc``. The ops
writing ``c4_out_loc`` / ``c128_out_loc`` are given R (``num_request_rows``) for that.

Shape legend: B = requests, T = query rows, R = request rows, L_max = tokens per request,
NP = L_max // 256, W = 128 (SWA window).
"""

import torch

from ..config import PAGE_SIZE
from ..metadata_chain import MetadataField, empty_outputs, fields_of
from ..reference import metadata as ref
from ._checks import (INDEX_DTYPES, check_devices, check_multiple_of, check_non_negative, check_positive,
                      check_same_rows, check_tensor)
from ._library import HAS_TRITON, dsv4_op

if HAS_TRITON:
    from .kernels import metadata as kernels


def _returns(fields: tuple[MetadataField, ...]):
    """The return annotation of an op producing ``fields``: one Tensor each (a bare Tensor for one)."""
    return torch.Tensor if len(fields) == 1 else tuple[(torch.Tensor,) * len(fields)]


def _launcher(op: str):
    """The Triton launcher registered as ``op``'s CUDA kernel (none without Triton)."""
    return getattr(kernels, f"launch_{op}") if HAS_TRITON else None


def _fake(op: str | None, num_tokens: int, n_pages: int | None, like: torch.Tensor):
    outs = tuple(empty_outputs(op, num_tokens, n_pages, like.device).values())
    return outs[0] if len(outs) == 1 else outs


def _check_rows(op: str, **tensors: torch.Tensor) -> None:
    for name, t in tensors.items():
        check_tensor(op, name, t, dtypes=INDEX_DTYPES, ndim=1)
    check_same_rows(op, **tensors)


def _check_req_to_token(op: str, req_to_token: torch.Tensor) -> None:
    check_tensor(op, "req_to_token", req_to_token, dtypes=INDEX_DTYPES, ndim=2)
    check_multiple_of(op, "req_to_token.shape[1]", req_to_token.shape[1], PAGE_SIZE)


def _check_step_tensors(op: str, req_rows, seq_lens, extend_lens, out_cache_loc) -> None:
    _check_rows(op, req_rows=req_rows, seq_lens=seq_lens, extend_lens=extend_lens)
    check_tensor(op, "out_cache_loc", out_cache_loc, dtypes=INDEX_DTYPES, ndim=1)


# -- expand_queries ----------------------------------------------------------------------------
def _check_expand(req_rows, seq_lens, extend_lens, out_cache_loc) -> None:
    check_devices("expand_queries", req_rows=req_rows, seq_lens=seq_lens, extend_lens=extend_lens,
                  out_cache_loc=out_cache_loc)
    _check_step_tensors("expand_queries", req_rows, seq_lens, extend_lens, out_cache_loc)


def _expand_fake(req_rows, seq_lens, extend_lens, out_cache_loc):
    return _fake("expand_queries", out_cache_loc.shape[0], None, out_cache_loc)


@dsv4_op("expand_queries", check=_check_expand, fake=_expand_fake, cuda=_launcher("expand_queries"))
def expand_queries(req_rows: torch.Tensor, seq_lens: torch.Tensor, extend_lens: torch.Tensor,
                   out_cache_loc: torch.Tensor) -> _returns(fields_of("expand_queries")):
    """One row per query token, ``T = out_cache_loc.shape[0]``; rows past ``sum(extend_lens)`` are
    padding (request 0, seq 1). Returns the op's fields (request row, position + 1, the request's
    first and end position this step)."""
    return ref.expand_queries(req_rows, seq_lens, extend_lens, out_cache_loc)


# -- build_page_table --------------------------------------------------------------------------
def _check_page_table(req_to_page, req_of_row, seq_lens_causal) -> None:
    check_devices("build_page_table", req_to_page=req_to_page, req_of_row=req_of_row, seq_lens_causal=seq_lens_causal)
    check_tensor("build_page_table", "req_to_page", req_to_page, dtypes=INDEX_DTYPES, ndim=2)
    _check_rows("build_page_table", req_of_row=req_of_row, seq_lens_causal=seq_lens_causal)


def _page_table_fake(req_to_page, req_of_row, seq_lens_causal):
    return _fake("build_page_table", req_of_row.shape[0], req_to_page.shape[1], req_of_row)


@dsv4_op("build_page_table", check=_check_page_table, fake=_page_table_fake,
         cuda=_launcher("build_page_table"))
def build_page_table(req_to_page: torch.Tensor, req_of_row: torch.Tensor,
                     seq_lens_causal: torch.Tensor) -> _returns(fields_of("build_page_table")):
    """The page table: full-pool page of each live 256-token page of the row's request, 0 after
    (``req_to_page [R, NP]``: the cache's compact page map)."""
    return ref.build_page_table(req_to_page, req_of_row, seq_lens_causal)


# -- build_swa_metadata ------------------------------------------------------------------------
def _check_swa(req_to_token, full_to_swa, req_of_row, seq_lens_causal, out_cache_loc) -> None:
    check_devices("build_swa_metadata", req_to_token=req_to_token, full_to_swa=full_to_swa, req_of_row=req_of_row,
                  seq_lens_causal=seq_lens_causal, out_cache_loc=out_cache_loc)
    _check_req_to_token("build_swa_metadata", req_to_token)
    check_tensor("build_swa_metadata", "full_to_swa", full_to_swa, dtypes=INDEX_DTYPES, ndim=1)
    _check_rows("build_swa_metadata", req_of_row=req_of_row, seq_lens_causal=seq_lens_causal,
                out_cache_loc=out_cache_loc)


def _swa_fake(req_to_token, full_to_swa, req_of_row, seq_lens_causal, out_cache_loc):
    return _fake("build_swa_metadata", req_of_row.shape[0], None, req_of_row)


@dsv4_op("build_swa_metadata", check=_check_swa, fake=_swa_fake, cuda=_launcher("build_swa_metadata"))
def build_swa_metadata(req_to_token: torch.Tensor, full_to_swa: torch.Tensor, req_of_row: torch.Tensor,
                       seq_lens_causal: torch.Tensor, out_cache_loc: torch.Tensor
                       ) -> _returns(fields_of("build_swa_metadata")):
    """The sliding-window fields: window slots newest first (-1 before position 0), window length
    and the SWA slot each row writes."""
    return ref.build_swa_metadata(req_to_token, full_to_swa, req_of_row, seq_lens_causal, out_cache_loc)


# -- build_c4_metadata -------------------------------------------------------------------------
def _check_c4(req_of_row, seq_lens_causal, out_cache_loc, topk, num_request_rows) -> None:
    check_devices("build_c4_metadata", req_of_row=req_of_row, seq_lens_causal=seq_lens_causal,
                  out_cache_loc=out_cache_loc)
    _check_rows("build_c4_metadata", req_of_row=req_of_row, seq_lens_causal=seq_lens_causal,
                out_cache_loc=out_cache_loc)
    check_positive("build_c4_metadata", "topk", topk)
    check_non_negative("build_c4_metadata", "num_request_rows", num_request_rows)


def _c4_fake(req_of_row, seq_lens_causal, out_cache_loc, topk, num_request_rows):
    return _fake("build_c4_metadata", seq_lens_causal.shape[0], None, seq_lens_causal)


@dsv4_op("build_c4_metadata", check=_check_c4, fake=_c4_fake, cuda=_launcher("build_c4_metadata"))
def build_c4_metadata(req_of_row: torch.Tensor, seq_lens_causal: torch.Tensor, out_cache_loc: torch.Tensor,
                      topk: int, num_request_rows: int) -> _returns(fields_of("build_c4_metadata")):
    """The ratio-4 fields (docs/semantics.md §3.5-3.6): write slot (-1 for rows that complete no
    window and for request rows outside ``[0, num_request_rows)``), visible entries and top-k
    attention length."""
    return ref.build_c4_metadata(req_of_row, seq_lens_causal, out_cache_loc, topk, num_request_rows)


# -- build_c128_metadata -----------------------------------------------------------------------
def _check_c128(page_table, req_of_row, seq_lens_causal, out_cache_loc, num_request_rows) -> None:
    check_devices("build_c128_metadata", page_table=page_table, req_of_row=req_of_row,
                  seq_lens_causal=seq_lens_causal, out_cache_loc=out_cache_loc)
    check_tensor("build_c128_metadata", "page_table", page_table, dtypes=INDEX_DTYPES, ndim=2)
    _check_rows("build_c128_metadata", req_of_row=req_of_row, seq_lens_causal=seq_lens_causal,
                out_cache_loc=out_cache_loc)
    check_same_rows("build_c128_metadata", page_table=page_table, seq_lens_causal=seq_lens_causal)
    check_non_negative("build_c128_metadata", "num_request_rows", num_request_rows)


def _c128_fake(page_table, req_of_row, seq_lens_causal, out_cache_loc, num_request_rows):
    return _fake("build_c128_metadata", seq_lens_causal.shape[0], page_table.shape[1], seq_lens_causal)


@dsv4_op("build_c128_metadata", check=_check_c128, fake=_c128_fake, cuda=_launcher("build_c128_metadata"))
def build_c128_metadata(page_table: torch.Tensor, req_of_row: torch.Tensor, seq_lens_causal: torch.Tensor,
                        out_cache_loc: torch.Tensor, num_request_rows: int
                        ) -> _returns(fields_of("build_c128_metadata")):
    """The ratio-128 fields (docs/semantics.md §3.5): write slot (-1 as for ratio 4), visible entry
    slots and their count."""
    return ref.build_c128_metadata(page_table, req_of_row, seq_lens_causal, out_cache_loc, num_request_rows)


# -- step_metadata: every op above in one launch --------------------------------------------------
def _check_step(req_rows, seq_lens, extend_lens, out_cache_loc, req_to_token, req_to_page, full_to_swa,
                topk) -> None:
    check_devices("step_metadata", req_rows=req_rows, seq_lens=seq_lens, extend_lens=extend_lens,
                  out_cache_loc=out_cache_loc, req_to_token=req_to_token, req_to_page=req_to_page,
                  full_to_swa=full_to_swa)
    _check_step_tensors("step_metadata", req_rows, seq_lens, extend_lens, out_cache_loc)
    _check_req_to_token("step_metadata", req_to_token)
    check_tensor("step_metadata", "req_to_page", req_to_page, dtypes=INDEX_DTYPES, ndim=2,
                 shape=(req_to_token.shape[0], req_to_token.shape[1] // PAGE_SIZE))
    check_tensor("step_metadata", "full_to_swa", full_to_swa, dtypes=INDEX_DTYPES, ndim=1)
    check_positive("step_metadata", "topk", topk)


def _step_fake(req_rows, seq_lens, extend_lens, out_cache_loc, req_to_token, req_to_page, full_to_swa, topk):
    return _fake(None, out_cache_loc.shape[0], req_to_page.shape[1], out_cache_loc)


@dsv4_op("step_metadata", check=_check_step, fake=_step_fake, cuda=_launcher("step_metadata"))
def step_metadata(req_rows: torch.Tensor, seq_lens: torch.Tensor, extend_lens: torch.Tensor,
                  out_cache_loc: torch.Tensor, req_to_token: torch.Tensor, req_to_page: torch.Tensor,
                  full_to_swa: torch.Tensor, topk: int) -> _returns(fields_of(None)):
    """Every field of the step, in ``metadata_chain.FIELDS`` order: the outputs of
    ``expand_queries``, ``build_page_table``, ``build_swa_metadata``, ``build_c4_metadata`` and
    ``build_c128_metadata``, equal to the separate ops'; on CUDA one launch instead of five."""
    return ref.step_metadata(req_rows, seq_lens, extend_lens, out_cache_loc, req_to_token, req_to_page,
                             full_to_swa, topk)
