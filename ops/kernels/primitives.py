"""Triton primitives shared by the kernels (all ``@triton.jit``, inlined where called).

* MODEL1 byte layout (``layout.py``) as constexprs, and reading a query row's keys out of MODEL1
  caches: a row's keys are its SWA list followed by its extra (c4 / c128) list, each cut at its
  length; "positions" index that concatenation. An entry is 576 data bytes (448 fp8 e4m3 nope
  values, 64 bf16 rope values) in its page's data area plus 8 scale bytes (7 ue8m0 scales, one
  per 64-wide nope tile) in the page's scale area.
* fp8 / bf16 bit helpers (exact casts where the interpreter's are not) and the Hadamard matrix.
* The online softmax: one block's update (:func:`softmax_rescale`), the attention-sink gate and
  the epilogue of a finished row (:func:`finish_rows`).

The warp-specialised kernel is Gluon, which cannot call these; it keeps Gluon copies of the few
it needs (each marked there).
"""

from __future__ import annotations

import triton
import triton.language as tl

from ... import layout
from ...config import HEAD_DIM, NOPE_DIM, ROPE_DIM

TILE = tl.constexpr(layout.FP8_TILE)
NUM_NOPE_TILES = tl.constexpr(layout.NUM_TILES)
DATA_BYTES = tl.constexpr(layout.TOKEN_DATA_BYTES)
SCALE_BYTES = tl.constexpr(layout.TOKEN_SCALE_BYTES)
NOPE = tl.constexpr(NOPE_DIM)
ROPE = tl.constexpr(ROPE_DIM)
DIM = tl.constexpr(HEAD_DIM)
DOT_MIN_ROWS = 16  # tl.dot's smallest tile dimension: fewer rows are padded to it
# a streaming GEMV/GEMM kernel's launch tile: (BLOCK_N, BLOCK_K, num_warps, num_stages)
TileConfig = tuple[int, int, int, int]
LOG2E = tl.constexpr(1.4426950408889634)
LN2 = tl.constexpr(0.6931471805599453)
assert layout.TOKEN_DATA_BYTES == NOPE_DIM + 2 * ROPE_DIM and ROPE_DIM == layout.FP8_TILE
assert HEAD_DIM == NOPE_DIM + ROPE_DIM


# -- memory hints ------------------------------------------------------------------------------
@triton.jit
def prefetch_l2(ptrs, mask, fallback):
    """Ask the L2 for the 128-byte line holding each of ``ptrs`` (a hint: nothing is loaded into
    registers; pass one pointer per line). Lanes off ``mask`` ask for ``fallback`` (an address
    inside the buffer) instead, so no request leaves the buffer."""
    tl.inline_asm_elementwise("prefetch.global.L2 [$1];", "=r,l", [tl.where(mask, ptrs, fallback)],
                              dtype=tl.int32, is_pure=False, pack=1)


_LINE = tl.constexpr(64)  # 2-byte elements per 128-byte line: one prefetch request each


@triton.jit
def prefetch_rows_l2(w_rows, row_ok, w_first, k_start, K, PREFETCH_K: tl.constexpr):
    """Ask the L2 for the lines of columns ``[k_start, k_start + PREFETCH_K)`` (``< K``) of the
    2-byte weight rows ``w_rows [BLOCK_N, 1]`` where ``row_ok``; masked lanes ask for ``w_first``
    (the weight's first element). Nothing when ``PREFETCH_K`` is 0."""
    if PREFETCH_K > 0:
        lines = k_start + tl.arange(0, PREFETCH_K // _LINE) * _LINE
        prefetch_l2(w_rows + lines[None, :], row_ok[:, None] & (lines < K)[None, :], w_first)


@triton.jit
def prefetch_then_wait(w_rows, row_ok, w_first, k_start, K, PREFETCH_K: tl.constexpr):
    """``PREFETCH_K > 0``: launched with PDL; the rows' columns as :func:`prefetch_rows_l2` asks for
    them, then :func:`dependent_launch` (wait for the predecessor, let the successor launch)."""
    prefetch_rows_l2(w_rows, row_ok, w_first, k_start, K, PREFETCH_K)
    dependent_launch(PREFETCH_K > 0)


@triton.jit
def dependent_launch(PDL: tl.constexpr):
    """For a kernel launched with programmatic dependent launch (``PDL``): wait until the kernel
    before it has finished and its writes are visible, then let the kernel after it launch (which
    waits likewise before it reads). Its launch and set-up then overlap the kernel before."""
    if PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()


# -- fp8 / bf16 bits, Hadamard -----------------------------------------------------------------
@triton.jit
def ceil_log2(x):
    """Exact ``ceil(log2(x))`` (int32) of positive normal fp32 ``x``, from its bits."""
    bits = x.to(tl.int32, bitcast=True)
    return (bits >> 23) - 127 + ((bits & 0x7FFFFF) != 0).to(tl.int32)


@triton.jit
def e4m3_rne_bits(x):
    """float8_e4m3fn bits (uint8) of finite fp32 ``|x| <= 448``, round-to-nearest-even."""
    bits = x.to(tl.int32, bitcast=True)
    sign = ((bits >> 31) & 1) << 7
    a = bits & 0x7FFFFFFF
    # normal range [2**-6, 448]: drop 20 mantissa bits with RNE; a carry bumps the exponent
    normal = ((a + 0x7FFFF + ((a >> 20) & 1)) >> 20) - ((127 - 7) << 3)
    # subnormal range: integer multiple of 2**-9, from the 24-bit significand
    mant = (a & 0x7FFFFF) | 0x800000
    shift = tl.minimum(14 - ((a >> 23) - 127), 31)
    sub = (mant + (1 << (shift - 1)) - 1 + ((mant >> shift) & 1)) >> shift
    return (tl.where(a >= 0x3C800000, normal, sub) | sign).to(tl.uint8)


@triton.jit
def to_e4m3_bits(x, SOFT_FP8: tl.constexpr):
    """``x`` (fp32, clamped to +-448) as float8_e4m3fn bits (uint8). ``SOFT_FP8`` (launchers pass
    it under the interpreter, whose fp32 -> fp8 cast mis-rounds when the mantissa carries into the
    exponent and can halve a value): the cast in integer arithmetic, which is exact everywhere."""
    if SOFT_FP8:
        return e4m3_rne_bits(x)
    else:
        return x.to(tl.float8e4nv).to(tl.uint8, bitcast=True)


@triton.jit
def ue8m0_to_fp32(e):
    """Scale byte ``e`` (int32, 1..254) -> ``2^(e - 127)``: the byte as an fp32 exponent field
    (``e = 0`` gives 0, not the subnormal ``2^-127``)."""
    return (e << 23).to(tl.float32, bitcast=True)


@triton.jit
def to_bf16(x, SOFT: tl.constexpr):
    """fp32 -> bf16, round to nearest even (the interpreter's cast truncates: there the rounding
    is done on the integer bits, after which the cast is exact)."""
    if SOFT:
        bits = x.to(tl.int32, bitcast=True)
        x = ((bits + 0x7FFF + ((bits >> 16) & 1)) & -65536).to(tl.float32, bitcast=True)
    return x.to(tl.bfloat16)


@triton.jit
def hadamard_pm1(n: tl.constexpr):
    """``[n, n]`` fp32 Sylvester Hadamard matrix: ``(-1) ** popcount(i & j)`` (n a power of two)."""
    p = tl.arange(0, n)[:, None] & tl.arange(0, n)[None, :]
    for level in tl.static_range(3, -1, -1):  # parity: fold the high half of the bits onto the low
        if (1 << (1 << level)) < n:  # bits at or above 2^level exist
            p = p ^ (p >> (1 << level))
    return (1 - 2 * (p & 1)).to(tl.float32)


# -- MODEL1 gather / dequantisation ------------------------------------------------------------
@triton.jit
def row_key_counts(swa, ex, row, HAS_EXTRA: tl.constexpr):
    """(SWA keys, all keys) of ``row``: each list's length clamped to [0, its width]. swa / ex: the
    lists' ``sparse_attn_args.EntryList`` arguments."""
    n_swa = tl.minimum(tl.maximum(tl.load(swa.lengths + row), 0), swa.width).to(tl.int32)
    n_all = n_swa
    if HAS_EXTRA:
        n_all += tl.minimum(tl.maximum(tl.load(ex.lengths + row), 0), ex.width).to(tl.int32)
    return n_swa, n_all


@triton.jit
def _slots(idx_row, m, in_set, capacity, P: tl.constexpr):
    """Slots at list positions ``m [BLOCK_N]`` -> (page int64, offset in page, valid). Invalid:
    outside the list, negative (-1 holes) or >= capacity."""
    slot = tl.load(idx_row + m, mask=in_set, other=-1)
    ok = in_set & (slot >= 0) & (slot < capacity)
    slot = tl.where(ok, slot, 0).to(tl.int32)  # < capacity < 2^31
    return (slot // P).to(tl.int64), slot % P, ok


@triton.jit
def gather_entries(pos, hi, n_swa, row, swa, ex, SWA_P: tl.constexpr, EX_P: tl.constexpr, HAS_EXTRA: tl.constexpr):
    """Entries at positions ``pos [BLOCK_N]`` of ``row`` -> (data, scales, valid): [BLOCK_N]
    uint8 pointers to each entry's data and scale bytes, and whether the position is below ``hi``
    and holds an in-range slot (invalid ones point at slot 0 of the SWA cache; mask their loads).
    swa / ex: the lists' ``sparse_attn_args.EntryList`` arguments."""
    in_swa = pos < n_swa
    page, off, valid = _slots(swa.indices + row * swa.index_stride, pos, in_swa & (pos < hi), swa.capacity, SWA_P)
    base = swa.cache + page * swa.page_stride
    data = base + off * DATA_BYTES
    scales = base + SWA_P * DATA_BYTES + off * SCALE_BYTES
    if HAS_EXTRA:
        ex_page, ex_off, ex_valid = _slots(ex.indices + row * ex.index_stride, pos - n_swa,
                                           (pos >= n_swa) & (pos < hi), ex.capacity, EX_P)
        ex_base = ex.cache + ex_page * ex.page_stride
        data = tl.where(in_swa, data, ex_base + ex_off * DATA_BYTES)
        scales = tl.where(in_swa, scales, ex_base + EX_P * DATA_BYTES + ex_off * SCALE_BYTES)
        valid = valid | ex_valid
    return data, scales, valid


@triton.jit
def dequant_nope(data, scale_word, valid, COL: tl.constexpr, WIDTH: tl.constexpr, DTYPE: tl.constexpr):
    """Nope columns ``[COL, COL + WIDTH)`` of ``BLOCK_N`` entries -> ``[BLOCK_N, WIDTH]`` DTYPE
    (0 for invalid entries), for a run of whole tiles whose scales lie in one 4-byte word.
    scale_word: [BLOCK_N] int32, the entry's scale bytes 4w..4w+3 (little endian). The scale is
    broadcast per column (a [BN, tiles, 64] reshape costs 14 % more on the H200)."""
    cols = tl.arange(0, WIDTH) + COL
    raw = tl.load(data[:, None] + cols[None, :], mask=valid[:, None], other=0)
    scale = ue8m0_to_fp32((scale_word[:, None] >> (8 * ((cols // TILE) % 4))[None, :]) & 0xFF)
    return (raw.to(tl.float8e4nv, bitcast=True).to(tl.float32) * scale).to(DTYPE)


@triton.jit
def scale_word(scales, valid, word):
    """Scale bytes ``4 word .. 4 word + 3`` of ``BLOCK_N`` entries as [BLOCK_N] int32 (0 for invalid
    ones): word 0 holds tiles 0-3, word 1 tiles 4-6. One 4-byte load per entry, which can be issued
    asynchronously ahead of its use (a 1-byte load cannot)."""
    return tl.load(scales.to(tl.pointer_type(tl.int32)) + word, mask=valid, other=0)


@triton.jit
def dequant_tile(data, word, valid, tile, DTYPE: tl.constexpr):
    """Nope tile ``tile`` (columns ``[64 tile, 64 tile + 64)``, runtime) of ``BLOCK_N`` entries ->
    ``[BLOCK_N, 64]`` DTYPE, 0 for invalid entries. word: the entries' scale word holding the tile
    (``scale_word(.., tile // 4)``)."""
    raw = tl.load(data[:, None] + (tl.arange(0, TILE) + tile * TILE)[None, :], mask=valid[:, None], other=0)
    scale = ue8m0_to_fp32((word >> (8 * (tile % 4))) & 0xFF)
    return (raw.to(tl.float8e4nv, bitcast=True).to(tl.float32) * scale[:, None]).to(DTYPE)


@triton.jit
def load_rope(data, valid, DTYPE: tl.constexpr):
    """The 64 bf16 rope values of ``BLOCK_N`` entries -> ``[BLOCK_N, 64]`` DTYPE, 0 for invalid."""
    rope = (data + NOPE).to(tl.pointer_type(tl.bfloat16))
    return tl.load(rope[:, None] + tl.arange(0, ROPE)[None, :], mask=valid[:, None], other=0.0).to(DTYPE)


# -- online softmax ----------------------------------------------------------------------------
@triton.jit
def softmax_rescale(m, x, AXIS: tl.constexpr, NATURAL: tl.constexpr):
    """One block of an online softmax: logits ``x`` (-inf where masked) reduced along ``AXIS`` into
    the running max ``m`` -> ``(m_new, alpha, p)``: the new running max, the factor rescaling the
    sums and accumulators of earlier blocks, and ``exp(x - m_new)`` (base 2, natural with
    ``NATURAL``). While no finite logit has been seen ``m_new`` is -inf and the exponentials use
    0 in its place: ``p = 0``, no NaN."""
    m_new = tl.maximum(m, tl.max(x, AXIS))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    if NATURAL:
        alpha = tl.exp(m - m_safe)
        p = tl.exp(x - tl.expand_dims(m_safe, AXIS))
    else:
        alpha = tl.exp2(m - m_safe)
        p = tl.exp2(x - tl.expand_dims(m_safe, AXIS))
    return m_new, alpha, p


@triton.jit
def row_lse2(m2, l):
    """Base-2 LSE ``m2 + log2(l)`` of finished rows (running max, sum) and whether a row had no
    valid key (``l == 0``; its LSE is then 0)."""
    empty = l == 0.0
    return tl.where(empty, 0.0, m2 + tl.log2(l)), empty


@triton.jit
def sink_gate(sink, heads, head_ok, lse2):
    """``1 / (1 + exp(sink - lse))`` for a base-2 ``lse2``; sink +inf -> 0, -inf -> 1."""
    s2 = tl.load(sink + heads, mask=head_ok, other=0.0) * LOG2E
    return 1.0 / (1.0 + tl.exp2(s2 - lse2))


@triton.jit
def finish_rows(m2, l, sink, heads, head_ok):
    """Epilogue of finished attention rows (base-2 running max ``m2``, sum ``l``) -> ``(scale,
    lse)``: the factor turning the accumulator into the output (sink gate / l; 0 for a row
    without valid keys) and the natural-log LSE without the sink (+inf for such a row)."""
    lse2, empty = row_lse2(m2, l)
    scale = tl.where(empty, 0.0, sink_gate(sink, heads, head_ok, lse2) / l)
    return scale, tl.where(empty, float("inf"), lse2 * LN2)


@triton.jit
def unsigned_key(x):
    """uint32 key with the order of the fp32 values (for finite values and ±inf; -0.0 below +0.0, a
    NaN with the sign bit clear above +inf): negative floats have every bit flipped, the others the
    sign bit."""
    bits = x.to(tl.int32, bitcast=True)
    return (bits ^ ((bits >> 31) | (-2147483647 - 1))).to(tl.uint32, bitcast=True)
