"""Seeded inputs for ``dsv4::sparse_attn`` tests and benchmarks: seeded generators, fragmented
pools and adversarial index content, so a kernel meets what serving can hand it.

Caches are written through the reference store (``reference.kv_store.store_model1``), so a kernel
under test reads exactly the bytes the spec defines. Index lists are drawn from the whole pool
(fragmented pages); optional adversarial content: ``-1`` holes, sentinel indices (INT32_MIN,
``capacity``, INT32_MAX) inside the row's length, ragged and over-long lengths, empty rows and
rows whose every index is invalid, and sinks of ``+inf`` / ``-inf``.

Shape legend: T = query rows, H = heads, K1 / K2 = SWA / extra index widths, P = page size.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from .. import layout
from ..attention import KVSet, op_args
from ..config import HEAD_DIM
from ..reference.kv_store import store_model1
from ..reference.sparse_attn import attend, gather_rows

EXTRA_PAGE_SIZE = {"c4": layout.C4_PAGE_SIZE, "c128": layout.C128_PAGE_SIZE}
_MAX_DISTINCT_SLOTS = 1 << 21  # beyond this many entries, rows share one pool (memory bound)
_INT32_MIN, _INT32_MAX = -(1 << 31), (1 << 31) - 1


@dataclass
class AttnInputs:
    """Arguments of ``attention.sparse_attn`` (see :meth:`args`)."""

    q: torch.Tensor  # [T, H, 512] bf16
    swa: KVSet  # MODEL1 pages of 256; indices [T, K1] int32, lengths [T] int32
    extra: KVSet | None  # MODEL1 pages of 64 or 2; indices [T, K2] int32, lengths [T] int32
    attn_sink: torch.Tensor  # [H] fp32
    softmax_scale: float

    def args(self) -> tuple:
        """``(q, swa, extra, attn_sink, softmax_scale)``: ``attention.sparse_attn``'s arguments,
        and the reference's and the kernels'."""
        return self.q, self.swa, self.extra, self.attn_sink, self.softmax_scale

    def op_args(self) -> tuple:
        """The 11 positional arguments of the ``dsv4::sparse_attn`` op (and its FlashMLA twin)."""
        return op_args(*self.args())

    def kv_sets(self) -> list[KVSet]:
        return [self.swa] if self.extra is None else [self.swa, self.extra]

    def entries_per_row(self) -> int:
        """Index width per row (SWA + extra): the entries a full-length row gathers."""
        return sum(kv.indices.shape[1] for kv in self.kv_sets())

    def with_int64_indices(self) -> AttnInputs:
        """The same inputs with int64 index lists and lengths."""
        wide = [kv._replace(indices=kv.indices.long(), lengths=kv.lengths.long()) for kv in self.kv_sets()]
        return replace(self, swa=wide[0], extra=wide[1] if self.extra is not None else None)


def random_keys(n: int, gen: torch.Generator, device) -> torch.Tensor:
    """``[n, 512] bf16`` keys whose 64-wide tiles have magnitudes 2^-2 .. 2^2 (varied fp8 scales)."""
    k = torch.randn(n, HEAD_DIM // layout.FP8_TILE, layout.FP8_TILE, generator=gen, device=device)
    mag = torch.exp2(torch.randint(-2, 3, (n, k.shape[1], 1), generator=gen, device=device).float())
    return (k * mag).reshape(n, HEAD_DIM).to(torch.bfloat16)


def make_model1_cache(num_slots: int, page_size: int, gen: torch.Generator, device) -> torch.Tensor:
    """A MODEL1 cache with at least ``num_slots`` slots, every slot holding a random key.

    Returns ``[N_pages, page_bytes] uint8`` with ``N_pages = ceil(num_slots / P) + 1`` (the pool's
    spare page, docs/semantics.md §2); padding bytes are zero.
    """
    num_pages = -(-num_slots // page_size) + 1
    cache = torch.zeros(num_pages, layout.model1_page_bytes(page_size), dtype=torch.uint8, device=device)
    slots = torch.arange(num_pages * page_size, device=device)
    for lo in range(0, slots.numel(), 1 << 18):  # bounded temporaries for 1M-context pools
        chunk = slots[lo:lo + (1 << 18)]
        store_model1(cache, chunk, random_keys(chunk.numel(), gen, device), page_size)
    return cache


def _random_kv_set(rows: int, width: int, page_size: int, capacity_hint: int | None, gen, device, *,
                   holes: float, ragged: bool, sentinels: bool, empty_rows: int) -> KVSet:
    """A cache with ``indices [rows, width] int32`` and ``lengths [rows] int32`` into it."""
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
    return KVSet(cache, page_size, idx.to(torch.int32), lengths.to(torch.int32))


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
    swa = _random_kv_set(num_rows, swa_width, layout.SWA_PAGE_SIZE, swa_capacity, gen, device, **kw)
    extra_set = None
    if extra is not None:
        extra_set = _random_kv_set(num_rows, extra_width, EXTRA_PAGE_SIZE[extra], extra_capacity, gen, device,
                                   **kw)
    for kv in (swa, extra_set):
        if kv is not None:
            kv.indices[:invalid_rows] = -1
    q = torch.randn(num_rows, num_heads, HEAD_DIM, generator=gen, device=device).to(torch.bfloat16)
    sink = torch.randn(num_heads, generator=gen, device=device)
    if special_sink:
        sink[0], sink[1 % num_heads] = float("inf"), float("-inf")
    return AttnInputs(q, swa, extra_set, sink, HEAD_DIM ** -0.5)


# -- comparison against an fp64 golden ------------------------------------------------------------
# A kernel's error against an fp64 golden is compared with the eager reference's error against the
# same golden, so the bar follows the inputs' own rounding instead of a fixed tolerance.
_GOLDEN_ROW_KEYS = 1 << 15  # rows x keys per fp64 chunk (each key 512 fp64)
OUT_FLOOR = 2.0 ** -8  # bf16 output: about one ulp, relative to the golden's magnitude
LSE_FLOOR = 64 * torch.finfo(torch.float32).eps  # fp32 lse: reduction-order and exp2/log2 slack


def golden_sparse_attn(inp: AttnInputs) -> tuple[torch.Tensor, torch.Tensor]:
    """docs/semantics.md §4.4 in fp64 on the same quantised cache entries, without the final
    roundings of the reference: ``out [T, H, 512] fp64``, ``lse [T, H] fp64`` (+inf for rows
    without valid keys)."""
    chunk = max(1, _GOLDEN_ROW_KEYS // inp.entries_per_row())
    outs, lses = [], []
    for lo in range(0, inp.q.shape[0], chunk):
        keys, valid = gather_rows(inp.kv_sets(), lo, lo + chunk, torch.float64)
        out, lse = attend(inp.q[lo:lo + chunk].double(), keys, valid, inp.attn_sink.double(), inp.softmax_scale)
        outs.append(out)
        lses.append(lse)
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
