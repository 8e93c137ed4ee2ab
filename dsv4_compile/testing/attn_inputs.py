"""Seeded inputs for ``dsv4::sparse_attn`` tests and benchmarks (STYLE habits 13, 14, 25).

Caches are written through the reference store (``reference.kv_store.store_model1``), so a kernel
under test reads exactly the bytes the spec defines. Index lists are drawn from the whole pool
(fragmented pages); optional adversarial content: ``-1`` holes, sentinel indices (INT32_MIN,
``capacity``, INT32_MAX) inside the row's length, ragged and over-long lengths, empty rows and
rows whose every index is invalid, and sinks of ``+inf`` / ``-inf``.

Shape legend: T = query rows, H = heads, K1 / K2 = SWA / extra index widths, P = page size.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .. import layout
from ..config import HEAD_DIM
from ..reference.kv_store import store_model1

EXTRA_PAGE_SIZE = {"c4": layout.C4_PAGE_SIZE, "c128": layout.C128_PAGE_SIZE}
_MAX_DISTINCT_SLOTS = 1 << 21  # beyond this many entries, rows share one pool (memory bound)
_INT32_MIN, _INT32_MAX = -(1 << 31), (1 << 31) - 1


@dataclass
class AttnInputs:
    """Arguments of ``dsv4::sparse_attn`` in op order (see :meth:`args`)."""

    q: torch.Tensor  # [T, H, 512] bf16
    swa_cache: torch.Tensor  # [N_pages, page_bytes] uint8, MODEL1 pages of 256
    swa_page_size: int
    swa_indices: torch.Tensor  # [T, K1] int32 slots
    swa_lengths: torch.Tensor  # [T] int32
    extra_cache: torch.Tensor | None  # [N_pages, page_bytes] uint8, MODEL1 pages of 64 or 2
    extra_page_size: int
    extra_indices: torch.Tensor | None  # [T, K2] int32 slots
    extra_lengths: torch.Tensor | None  # [T] int32
    attn_sink: torch.Tensor  # [H] fp32
    softmax_scale: float

    def args(self) -> tuple:
        return (self.q, self.swa_cache, self.swa_page_size, self.swa_indices, self.swa_lengths,
                self.extra_cache, self.extra_page_size, self.extra_indices, self.extra_lengths,
                self.attn_sink, self.softmax_scale)

    def entries_per_row(self) -> int:
        """Index width per row (SWA + extra): the entries a full-length row gathers."""
        extra = 0 if self.extra_indices is None else self.extra_indices.shape[1]
        return self.swa_indices.shape[1] + extra


def random_keys(n: int, gen: torch.Generator, device) -> torch.Tensor:
    """``[n, 512] bf16`` keys whose 64-wide tiles have magnitudes 2^-2 .. 2^2 (varied fp8 scales)."""
    k = torch.randn(n, HEAD_DIM // layout.FP8_TILE, layout.FP8_TILE, generator=gen, device=device)
    mag = torch.exp2(torch.randint(-2, 3, (n, k.shape[1], 1), generator=gen, device=device).float())
    return (k * mag).reshape(n, HEAD_DIM).to(torch.bfloat16)


def make_model1_cache(num_slots: int, page_size: int, gen: torch.Generator, device) -> torch.Tensor:
    """A MODEL1 cache with at least ``num_slots`` slots, every slot holding a random key.

    Returns ``[N_pages, page_bytes] uint8`` with ``N_pages = ceil(num_slots / P) + 1`` (the pool's
    spare page, SPEC §2); padding bytes are zero.
    """
    num_pages = -(-num_slots // page_size) + 1
    cache = torch.zeros(num_pages, layout.model1_page_bytes(page_size), dtype=torch.uint8, device=device)
    slots = torch.arange(num_pages * page_size, device=device)
    for lo in range(0, slots.numel(), 1 << 18):  # bounded temporaries for 1M-context pools
        chunk = slots[lo:lo + (1 << 18)]
        store_model1(cache, chunk, random_keys(chunk.numel(), gen, device), page_size)
    return cache


def _index_set(rows: int, width: int, page_size: int, capacity_hint: int | None, gen, device, *,
               holes: float, ragged: bool, sentinels: bool, empty_rows: int):
    """Cache, ``indices [rows, width] int32`` and ``lengths [rows] int32`` for one index set."""
    distinct = rows * width
    capacity = capacity_hint or min(distinct, _MAX_DISTINCT_SLOTS)
    cache = make_model1_cache(capacity, page_size, gen, device)
    slots_total = cache.shape[0] * page_size
    if distinct <= slots_total:  # every row its own entries, scattered over the pool
        idx = torch.randperm(slots_total, generator=gen, device=device)[:distinct].view(rows, width)
    else:
        idx = torch.randint(0, slots_total, (rows, width), generator=gen, device=device)
    idx = idx.to(torch.int64)
    if holes:
        idx = torch.where(torch.rand(idx.shape, generator=gen, device=device) < holes, -1, idx)
    if sentinels:
        pick = torch.randint(0, width, (rows, 3), generator=gen, device=device)
        bad = torch.tensor([_INT32_MIN, slots_total, _INT32_MAX], device=device).expand(rows, 3)
        idx = idx.scatter(1, pick, bad)
    lengths = torch.full((rows,), width, dtype=torch.int64, device=device)
    if ragged:
        lengths = torch.randint(0, width + 1, (rows,), generator=gen, device=device)
        lengths[0] = width + 7  # longer than the list: clamps to the width
    if empty_rows:
        lengths[-empty_rows:] = 0
    return cache, idx.to(torch.int32), lengths.to(torch.int32)


def make_attn_inputs(num_rows: int, num_heads: int, *, extra: str | None = "c4", swa_width: int = 128,
                     extra_width: int = 512, swa_capacity: int | None = None,
                     extra_capacity: int | None = None, holes: float = 0.0, ragged: bool = False,
                     sentinels: bool = False, empty_rows: int = 0, invalid_rows: int = 0,
                     special_sink: bool = False, seed: int = 0, device="cpu") -> AttnInputs:
    """Seeded inputs for one sparse-attention call.

    extra: ``"c4"``, ``"c128"`` or ``None`` (SWA-only layer). Capacities (entries) default to one
    distinct entry per (row, index) up to ``2^21``. ``empty_rows``: the last rows get length 0;
    ``invalid_rows``: the first rows keep their lengths but every index is -1 (both give out 0,
    lse +inf). ``special_sink``: head 0 sink ``+inf``, head 1 ``-inf``.
    """
    gen = torch.Generator(device=device).manual_seed(seed)
    kw = dict(holes=holes, ragged=ragged, sentinels=sentinels, empty_rows=empty_rows)
    swa_cache, swa_idx, swa_len = _index_set(num_rows, swa_width, layout.SWA_PAGE_SIZE, swa_capacity,
                                             gen, device, **kw)
    extra_cache = extra_idx = extra_len = None
    extra_page_size = 0
    if extra is not None:
        extra_page_size = EXTRA_PAGE_SIZE[extra]
        extra_cache, extra_idx, extra_len = _index_set(num_rows, extra_width, extra_page_size,
                                                       extra_capacity, gen, device, **kw)
    if invalid_rows:
        swa_idx[:invalid_rows] = -1
        if extra_idx is not None:
            extra_idx[:invalid_rows] = -1
    q = torch.randn(num_rows, num_heads, HEAD_DIM, generator=gen, device=device).to(torch.bfloat16)
    sink = torch.randn(num_heads, generator=gen, device=device)
    if special_sink:
        sink[0], sink[1 % num_heads] = float("inf"), float("-inf")
    return AttnInputs(q, swa_cache, layout.SWA_PAGE_SIZE, swa_idx, swa_len, extra_cache, extra_page_size,
                      extra_idx, extra_len, sink, HEAD_DIM ** -0.5)


# -- comparison against an fp64 golden (STYLE habit 11) --------------------------------------------
_GOLDEN_ROW_KEYS = 1 << 15  # rows x keys per fp64 chunk (each key 512 fp64)
OUT_FLOOR = 2.0 ** -8  # bf16 output: about one ulp, relative to the golden's magnitude
LSE_FLOOR = 64 * torch.finfo(torch.float32).eps  # fp32 lse: reduction-order and exp2/log2 slack


def golden_sparse_attn(inp: AttnInputs) -> tuple[torch.Tensor, torch.Tensor]:
    """SPEC §4.4 in fp64 on the same quantised cache entries, without the final roundings of the
    reference: ``out [T, H, 512] fp64``, ``lse [T, H] fp64`` (+inf for rows without valid keys)."""
    from ..reference.kv_store import gather_model1

    sets = [(inp.swa_cache, inp.swa_page_size, inp.swa_indices, inp.swa_lengths)]
    if inp.extra_cache is not None:
        sets.append((inp.extra_cache, inp.extra_page_size, inp.extra_indices, inp.extra_lengths))
    chunk = max(1, _GOLDEN_ROW_KEYS // inp.entries_per_row())
    outs, lses = [], []
    for lo in range(0, inp.q.shape[0], chunk):
        keys, valid = [], []
        for cache, page_size, idx, lens in sets:
            idx, lens = idx[lo:lo + chunk].long(), lens[lo:lo + chunk].long()
            m = torch.arange(idx.shape[1], device=idx.device)
            ok = (m < lens[:, None]) & (idx >= 0) & (idx < cache.shape[0] * page_size)
            keys.append(gather_model1(cache, torch.where(ok, idx, -1), page_size).double())
            valid.append(ok)
        k, ok = torch.cat(keys, 1), torch.cat(valid, 1)  # [C, K, 512], [C, K]
        logits = torch.einsum("chd,ckd->chk", inp.q[lo:lo + chunk].double(), k) * inp.softmax_scale
        logits = logits.masked_fill(~ok[:, None, :], float("-inf"))
        lse = torch.logsumexp(logits, -1)  # [C, H]
        empty = torch.isneginf(lse)
        safe = torch.where(empty, 0.0, lse)
        gate = torch.sigmoid(safe - inp.attn_sink.double())
        out = torch.einsum("chk,ckd->chd", torch.exp(logits - safe[..., None]), k) * gate[..., None]
        outs.append(torch.where(empty[..., None], 0.0, out))
        lses.append(torch.where(empty, float("inf"), lse))
    return torch.cat(outs), torch.cat(lses)


def _worst(err: torch.Tensor) -> str:
    where = torch.unravel_index(err.argmax(), err.shape)
    return f"max {err.max().item():.3e} at {tuple(int(i) for i in where)}"


def assert_attn_close(got: tuple[torch.Tensor, torch.Tensor], eager: tuple[torch.Tensor, torch.Tensor],
                      golden: tuple[torch.Tensor, torch.Tensor], what: str = "kernel") -> None:
    """Kernel vs eager, both against the fp64 golden: ``err_kernel <= 2 * err_eager + floor`` on
    max and mean, for out and lse separately; infinite / NaN lse positions must match exactly."""
    (out, lse), (e_out, e_lse), (g_out, g_lse) = got, eager, golden
    out, lse, e_out, e_lse = (t.double().cpu() for t in (out, lse, e_out, e_lse))
    g_out, g_lse = g_out.cpu(), g_lse.cpu()
    assert not out.isnan().any() and not lse.isnan().any(), f"{what}: NaN in the output"
    assert torch.equal(lse.isinf(), g_lse.isinf()) and torch.equal(lse[lse.isinf()], g_lse[g_lse.isinf()]), \
        f"{what}: infinite lse positions differ"
    fin = g_lse.isfinite()
    checks = [("out", out - g_out, e_out - g_out, OUT_FLOOR * g_out.abs().max().clamp_min(1e-30),
               OUT_FLOOR * g_out.abs().mean()),
              ("lse", torch.where(fin, lse - g_lse, 0.0), torch.where(fin, e_lse - g_lse, 0.0),
               LSE_FLOOR * g_lse[fin].abs().max().clamp_min(1.0) if fin.any() else 0.0, LSE_FLOOR)]
    for name, err, err_eager, floor_max, floor_mean in checks:
        err, err_eager = err.abs(), err_eager.abs()
        assert err.max() <= 2 * err_eager.max() + floor_max, \
            f"{what} {name}: {_worst(err)} > 2 x eager {err_eager.max().item():.3e} + {float(floor_max):.3e}"
        assert err.mean() <= 2 * err_eager.mean() + floor_mean, \
            f"{what} {name}: mean {err.mean().item():.3e} > 2 x eager {err_eager.mean().item():.3e} + floor"
