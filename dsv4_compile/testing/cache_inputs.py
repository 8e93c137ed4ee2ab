"""Seeded inputs for cache-write and metadata kernels (tests and benchmarks).

Every factory takes a ``torch.Generator`` on the target device, so the same seed gives the same
inputs wherever a test runs. Index maps are fragmented: each request's pages are drawn from a
shuffled pool twice as large as needed (so neighbouring pages of a request are far apart, as
after many admissions and releases), and positions past a request's length keep stale slots, as
a real allocator leaves them.
"""

from __future__ import annotations

import dataclasses

import torch

from .. import layout
from ..config import HEAD_DIM, INDEX_HEAD_DIM, PAGE_SIZE
from ..metadata_chain import named
from ..reference import metadata as ref_meta
from ..step import ForwardMode, StepInputs


def model1_keys(n: int, gen: torch.Generator) -> torch.Tensor:
    """``[n, 512] bf16`` keys whose 64-wide tiles span magnitudes 2**-20 .. 2**12, with corner
    tiles: all zero (the amax floor), amax exactly ``448 * 2**j`` (scale boundary) and tiny."""
    device = gen.device
    k = torch.randn(n, HEAD_DIM, generator=gen, device=device)
    tile_exp = torch.randint(-20, 13, (n, HEAD_DIM // layout.FP8_TILE), generator=gen, device=device)
    k = k * torch.exp2(tile_exp.float()).repeat_interleave(layout.FP8_TILE, dim=1)
    if n > 0:
        k[0, :layout.FP8_TILE] = 0.0
    if n > 1:
        k[1, layout.FP8_TILE:2 * layout.FP8_TILE] = k[1, layout.FP8_TILE:2 * layout.FP8_TILE].clamp(-1, 1)
        k[1, layout.FP8_TILE] = -layout.FP8_MAX * 4  # amax / 448 is exactly a power of two
    if n > 2:
        k[2, 2 * layout.FP8_TILE:3 * layout.FP8_TILE] *= 1e-7  # below the 1e-4 amax floor
    return k.to(torch.bfloat16)


def all_bf16_tiles() -> torch.Tensor:
    """Every finite bf16 value in ``[-448, 448]`` laid out in nope tiles whose amax is exactly 448
    (scale 1), so the fp8 cast of every possible input is exercised: ``[rows, 512] bf16`` (CPU)."""
    bits = torch.arange(0, 1 << 16, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)
    vals = bits[torch.isfinite(bits) & (bits.float().abs() <= layout.FP8_MAX)]
    per_tile = layout.FP8_TILE - 1
    n_tiles = -(-vals.numel() // per_tile)
    tiles = torch.zeros(n_tiles * per_tile, dtype=torch.bfloat16)
    tiles[:vals.numel()] = vals
    tiles = torch.cat([torch.full((n_tiles, 1), layout.FP8_MAX, dtype=torch.bfloat16),
                       tiles.view(n_tiles, per_tile)], dim=1)  # [n_tiles, 64]
    rows = -(-n_tiles // layout.NUM_TILES)
    nope = torch.full((rows * layout.NUM_TILES, layout.FP8_TILE), layout.FP8_MAX, dtype=torch.bfloat16)
    nope[:n_tiles] = tiles
    rope = torch.zeros(rows, HEAD_DIM - layout.NUM_TILES * layout.FP8_TILE, dtype=torch.bfloat16)
    return torch.cat([nope.view(rows, -1), rope], dim=1)


def index_keys(n: int, dtype: torch.dtype, gen: torch.Generator) -> torch.Tensor:
    """``[n, 128]`` indexer keys with per-row magnitudes 2**-20 .. 2**12; row 0 below the floor."""
    k = torch.randn(n, INDEX_HEAD_DIM, generator=gen, device=gen.device)
    k = k * torch.exp2(torch.randint(-20, 13, (n, 1), generator=gen, device=gen.device).float())
    if n > 0:
        k[0] *= 1e-9
    return k.to(dtype)


def distinct_slots(n: int, num_pages: int, page_size: int, gen: torch.Generator, *,
                   dtype: torch.dtype = torch.int64, num_negative: int = 0) -> torch.Tensor:
    """``[n]`` distinct slots on pages ``1..num_pages-1`` (page 0 is the dummy), the last
    ``num_negative`` of them replaced by -1 (rows to skip), in shuffled order."""
    if n > (num_pages - 1) * page_size:
        raise ValueError(f"{n} slots do not fit in {num_pages - 1} pages of {page_size}")
    slots = torch.randperm((num_pages - 1) * page_size, generator=gen, device=gen.device)[:n] + page_size
    slots[n - num_negative:] = -1
    return slots[torch.randperm(n, generator=gen, device=gen.device)].to(dtype)


def index_maps(num_requests: int, max_seq_len: int, gen: torch.Generator, *,
               pool_factor: int = 2) -> tuple[torch.Tensor, torch.Tensor]:
    """Fragmented ``req_to_token [num_requests + 1, max_seq_len] int32`` (row 0: the dummy, all
    zeros) and ``full_to_swa [F * 256] int32`` (0 for slot 0, else a random SWA slot)."""
    device = gen.device
    n_pages = max_seq_len // PAGE_SIZE
    pool = pool_factor * num_requests * n_pages + 1
    pages = torch.randperm(pool - 1, generator=gen, device=device)[:num_requests * n_pages] + 1
    offsets = torch.arange(PAGE_SIZE, dtype=torch.int32, device=device)
    rows = (pages.to(torch.int32).view(num_requests, n_pages, 1) * PAGE_SIZE + offsets).view(num_requests, -1)
    req_to_token = torch.cat([torch.zeros(1, max_seq_len, dtype=torch.int32, device=device), rows])
    full_to_swa = torch.randint(1, 1 << 30, (pool * PAGE_SIZE,), generator=gen, device=device,
                                dtype=torch.int32)
    full_to_swa[0] = 0
    return req_to_token, full_to_swa


def make_step(req_to_token: torch.Tensor, req_rows, seq_lens, extend_lens, num_tokens: int | None = None, *,
              mode: ForwardMode = ForwardMode.EXTEND) -> StepInputs:
    """A step on ``req_to_token``'s device (``StepInputs.make``) whose real rows write the full slot
    of their position; ``num_tokens`` (default ``sum(extend_lens)``) rows in all, the padding rows
    writing the dummy slot 0. The mode only decides which compressed fields
    ``build_step_metadata`` builds (none for ``DRAFT_EXTEND``)."""
    device = req_to_token.device
    extend_lens = torch.as_tensor(extend_lens, dtype=torch.int32, device=device)
    t = int(extend_lens.sum()) if num_tokens is None else num_tokens
    step = StepInputs.make(mode, req_rows, seq_lens, extend_lens, [], num_tokens=t, device=device)
    rows = named(ref_meta.expand_queries(*step.tensors()), "expand_queries")
    real = torch.arange(t, device=device) < step.extend_lens.sum()
    slots = req_to_token[rows["req_of_row"].long(), rows["seq_lens_causal"].long() - 1].long()
    return dataclasses.replace(step, out_cache_loc=torch.where(real, slots, 0))
