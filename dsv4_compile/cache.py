"""The paged DSV4 KV cache: fixed-capacity ``nn.Module`` buffers (docs/semantics.md §2).

Index space (shared by all layers):

* ``req_to_token [R, L_max] int32`` — full slot of (request row, position); row 0 is the reserved
  dummy request that padding rows use (all zeros).
* ``req_to_page [R, L_max / 256] int32`` — full page of each 256-token page of a request
  (``req_to_token[r, 256 i] // 256``), kept so a page-table row is one contiguous read.
* ``full_to_swa [F * 256] int32`` — SWA slot of each full slot, 0 when the token has no SWA storage.

Per layer (``layers[i]``, a :class:`LayerCache`):

* ``swa_kv [S, 149760] uint8`` — MODEL1 pages of 256 raw tokens (every layer).
* ``extra_kv`` — c4 pages ``[F, 37440]`` (64 entries) or c128 pages ``[F, 1728]`` (2 entries),
  indexed by full page id: compressed page P holds the entries of full page P.
* ``index_k [F, 8448] uint8`` — indexer keys, 64 per page (ratio 4).
* ``kv_state [R * ring, 2 Wc] fp32`` / ``index_state`` — compressor rings (docs/semantics.md §2.5), row
  ``req * ring + pos % ring``.

Slot / page / row 0 of every pool is the dummy target and never handed out.
Buffers have fixed addresses for the cache's lifetime, so CUDA graphs can read and write them.
"""

from __future__ import annotations

import torch
from torch import nn

from . import layout
from .config import HEAD_DIM, INDEX_HEAD_DIM, PAGE_SIZE, DSV4AttnConfig
from .counts import check_count

_EXTRA_PAGE_SIZE = {4: layout.C4_PAGE_SIZE, 128: layout.C128_PAGE_SIZE}


def _u8(pages: int, page_bytes: int, device) -> torch.Tensor:
    return torch.zeros(pages, page_bytes, dtype=torch.uint8, device=device)


class LayerCache(nn.Module):
    """The pools of one attention layer; which buffers exist depends on its compress ratio."""

    def __init__(self, config: DSV4AttnConfig, ratio: int, *, num_requests: int, num_full_pages: int,
                 num_swa_pages: int, device=None):
        super().__init__()
        self.ratio = ratio
        self.register_buffer("swa_kv", _u8(num_swa_pages, layout.model1_page_bytes(PAGE_SIZE), device))
        if ratio == 0:
            return
        self.extra_page_size = _EXTRA_PAGE_SIZE[ratio]
        self.register_buffer("extra_kv", _u8(num_full_pages, layout.model1_page_bytes(self.extra_page_size),
                                             device))
        self.ring = config.state_ring(ratio)
        coff = 2 if ratio == 4 else 1
        self.register_buffer("kv_state", torch.zeros(num_requests * self.ring, 2 * coff * HEAD_DIM,
                                                     device=device))
        if ratio == 4:
            self.register_buffer("index_k", _u8(num_full_pages, layout.index_page_bytes(), device))
            self.register_buffer("index_state", torch.zeros(num_requests * self.ring, 4 * INDEX_HEAD_DIM,
                                                            device=device))


class DSV4Cache(nn.Module):
    """All pools of a stack of DSV4 attention layers.

    Args:
        config: the attention config (one LayerCache per entry of ``compress_ratios``).
        max_requests: concurrent requests (request rows ``1..max_requests``; row 0 is the dummy).
        max_seq_len: tokens per request, a multiple of 256; fixes the page-table width.
        num_full_pages: full-pool pages (default: enough for every request at ``max_seq_len``).
        num_swa_pages: SWA-pool pages (default: ``num_full_pages``); the window only needs about
            two pages per request in decode, more while prefilling long chunks.
    """

    def __init__(self, config: DSV4AttnConfig, *, max_requests: int, max_seq_len: int,
                 num_full_pages: int | None = None, num_swa_pages: int | None = None, device=None):
        super().__init__()
        for name, value in (("max_requests", max_requests), ("max_seq_len", max_seq_len),
                            ("num_full_pages", num_full_pages), ("num_swa_pages", num_swa_pages)):
            if value is not None:
                check_count(name, value)
        if max_requests < 1:
            raise ValueError(f"max_requests={max_requests} must be >= 1")
        if max_seq_len < PAGE_SIZE or max_seq_len % PAGE_SIZE:
            raise ValueError(f"max_seq_len={max_seq_len} must be a positive multiple of {PAGE_SIZE}")
        self.config = config
        self.max_requests = max_requests
        self.max_seq_len = max_seq_len
        pages_of_every_request = max_requests * (max_seq_len // PAGE_SIZE) + 1
        self.num_full_pages = pages_of_every_request if num_full_pages is None else num_full_pages
        self.num_swa_pages = self.num_full_pages if num_swa_pages is None else num_swa_pages
        if self.num_full_pages < 2 or self.num_swa_pages < 2:
            raise ValueError("num_full_pages and num_swa_pages must be >= 2 (page 0 is the dummy)")
        rows = max_requests + 1
        self.register_buffer("req_to_token", torch.zeros(rows, max_seq_len, dtype=torch.int32, device=device))
        self.register_buffer("req_to_page", torch.zeros(rows, max_seq_len // PAGE_SIZE, dtype=torch.int32,
                                                        device=device))
        self.register_buffer("full_to_swa", torch.zeros(self.num_full_pages * PAGE_SIZE, dtype=torch.int32,
                                                        device=device))
        self.layers = nn.ModuleList(
            LayerCache(config, r, num_requests=rows, num_full_pages=self.num_full_pages,
                       num_swa_pages=self.num_swa_pages, device=device)
            for r in config.compress_ratios)

    @property
    def device(self) -> torch.device:
        return self.req_to_token.device

    def clear_request_state(self, row: int) -> None:
        """Zero request row ``row``'s compressor state rings in every layer (a new request)."""
        for layer in self.layers:
            for name in ("kv_state", "index_state"):
                state = getattr(layer, name, None)
                if state is not None:
                    state[row * layer.ring:(row + 1) * layer.ring] = 0

    def nbytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self.buffers())
