"""The step metadata chain, declared once: the fields it produces and how its ops feed each other.

:data:`FIELDS` lists every output of the chain's five ``dsv4::`` ops — name, dtype, shape rule and
the op that produces it — in the order the fused ``dsv4::step_metadata`` returns them. Everything
else is derived from it: the ``StepMetadata`` dataclass, the reference's output order, the fake
shapes of the ops, the Triton kernels' output buffers and the FX pass's output mapping.
:func:`run_chain` is the one place the ops are wired together (``build_step_metadata`` runs it
through ``torch.ops.dsv4``, the fused op's reference through the reference functions).

Shape legend: T = query rows, NP = pages per request (``L_max // 256``), W = SWA window (128),
K = c128 index width (``2 NP`` rounded up to a multiple of 64), R = request rows of the index maps.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass

import torch

from .config import INDEX_ALIGN, SWA_WINDOW


def ceil_to(x: int, m: int) -> int:
    return -(-x // m) * m


def _page_columns(n_pages: int) -> int:
    return n_pages


def _swa_columns(n_pages: int) -> int:
    return SWA_WINDOW


def c128_columns(n_pages: int) -> int:
    """Two ratio-128 entries per 256-token page, padded like every index list handed to attention."""
    return ceil_to(2 * n_pages, INDEX_ALIGN)


@dataclass(frozen=True)
class MetadataField:
    """One output of the chain. ``columns`` maps NP to the width of a ``[T, width]`` field (None:
    a ``[T]`` field); ``ratio`` is 0 for a field every layer reads, else the compression ratio of
    the only layers that read it (the field is then built only for stacks with such layers)."""

    name: str
    op: str
    doc: str
    columns: Callable[[int], int] | None = None
    ratio: int = 0
    dtype: torch.dtype = torch.int32

    def shape(self, num_tokens: int, n_pages: int | None = None) -> tuple[int, ...]:
        return (num_tokens,) if self.columns is None else (num_tokens, self.columns(n_pages))


FIELDS = (
    MetadataField("req_of_row", "expand_queries", "[T] request row of each query row (0 for padding)"),
    MetadataField("seq_lens_causal", "expand_queries", "[T] position + 1 (1 for padding)"),
    MetadataField("extend_start", "expand_queries", "[T] first position of the row's request this step"),
    MetadataField("extend_end", "expand_queries", "[T] post-step length of the row's request"),
    MetadataField("positions", "expand_queries", "[T] position of the row's token, seq_lens_causal - 1 (0 for padding)"),
    MetadataField("page_table", "build_page_table", "[T, NP] full page of each live page, 0 after",
                  _page_columns),
    MetadataField("swa_indices", "build_swa_metadata", "[T, W] window slots newest first, -1 before 0",
                  _swa_columns),
    MetadataField("swa_lengths", "build_swa_metadata", "[T] min(position + 1, W)"),
    MetadataField("swa_out_loc", "build_swa_metadata",
                  "[T] SWA slot the row's token is written to, -1 for none (a request row outside [0, R) included)"),
    MetadataField("c4_out_loc", "build_c4_metadata",
                  "[T] ratio-4 write slot, -1 off a window end, for slot < 0 or a request row outside [0, R)",
                  ratio=4),
    MetadataField("c4_visible", "build_c4_metadata", "[T] ratio-4 entries the row may see", ratio=4),
    MetadataField("c4_topk_lengths", "build_c4_metadata", "[T] attention length of the top-k list",
                  ratio=4),
    MetadataField("c128_out_loc", "build_c128_metadata",
                  "[T] ratio-128 write slot, -1 off a window end, for slot < 0 or a request row outside [0, R)",
                  ratio=128),
    MetadataField("c128_indices", "build_c128_metadata", "[T, K] visible ratio-128 slots, -1 after",
                  c128_columns, ratio=128),
    MetadataField("c128_lengths", "build_c128_metadata", "[T] max(visible ratio-128 entries, 1)",
                  ratio=128),
)
FIELD_NAMES = tuple(f.name for f in FIELDS)
FIELDS_BY_NAME = {f.name: f for f in FIELDS}
CHAIN_OPS = tuple(dict.fromkeys(f.op for f in FIELDS))  # the five ops, in chain order


def fields_of(op: str | None) -> tuple[MetadataField, ...]:
    """The outputs of ``op`` in its schema's order; ``None``: every field (``step_metadata``)."""
    return FIELDS if op is None else tuple(f for f in FIELDS if f.op == op)


def output_index(name: str) -> int:
    """Where field ``name`` stands among the outputs of the op that produces it."""
    f = FIELDS_BY_NAME[name]
    return fields_of(f.op).index(f)


def fused_positions(op: str) -> tuple[int, ...]:
    """Where each output of ``op`` stands among ``step_metadata``'s outputs."""
    return tuple(FIELDS.index(f) for f in fields_of(op))


def named(outputs: torch.Tensor | Sequence[torch.Tensor], op: str | None = None) -> dict[str, torch.Tensor]:
    """``{field name: tensor}`` of what ``op`` returned (a single tensor for a one-field op);
    ``op=None``: the outputs of ``step_metadata``."""
    fields = fields_of(op)
    values = (outputs,) if isinstance(outputs, torch.Tensor) else outputs
    return {f.name: t for f, t in zip(fields, values, strict=True)}


def empty_outputs(op: str | None, num_tokens: int, n_pages: int | None, device) -> dict[str, torch.Tensor]:
    """Uninitialised outputs of ``op`` (``None``: of ``step_metadata``) for T = ``num_tokens`` rows
    and NP = ``n_pages``: what the kernels write and what the fakes return."""
    return {f.name: torch.empty(f.shape(num_tokens, n_pages), dtype=f.dtype, device=device)
            for f in fields_of(op)}


def run_chain(impl, req_rows: torch.Tensor, seq_lens: torch.Tensor, extend_lens: torch.Tensor,
              out_cache_loc: torch.Tensor, req_to_token: torch.Tensor, req_to_page: torch.Tensor,
              full_to_swa: torch.Tensor, topk: int, ratios: Collection[int] = (4, 128)
              ) -> dict[str, torch.Tensor]:
    """Every field of one step through ``impl``: an object holding the chain's ops by name, each
    with its op's signature (``torch.ops.dsv4``, or the reference module). Fields of ratio r are
    built only when r is in ``ratios``. Returns ``{field name: tensor}`` in :data:`FIELDS` order.
    Every op that writes an out slot is given the request rows R of the index maps, so a row of a
    request row outside ``[0, R)`` writes nothing."""
    out = named(impl.expand_queries(req_rows, seq_lens, extend_lens, out_cache_loc), "expand_queries")
    req_of_row, seq_causal, num_rows = out["req_of_row"], out["seq_lens_causal"], req_to_token.shape[0]
    out |= named(impl.build_page_table(req_to_page, req_of_row, seq_causal), "build_page_table")
    out |= named(impl.build_swa_metadata(req_to_token, full_to_swa, req_of_row, seq_causal, out_cache_loc),
                 "build_swa_metadata")
    if 4 in ratios:
        out |= named(impl.build_c4_metadata(req_of_row, seq_causal, out_cache_loc, topk, num_rows),
                     "build_c4_metadata")
    if 128 in ratios:
        out |= named(impl.build_c128_metadata(out["page_table"], req_of_row, seq_causal, out_cache_loc, num_rows),
                     "build_c128_metadata")
    return out
