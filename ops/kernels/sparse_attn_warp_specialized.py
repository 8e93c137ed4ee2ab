"""Warp-specialised sparse MQA with sink for Hopper (``dsv4::sparse_attn``, docs/semantics.md
§4.4) — Gluon.

The same work split as the fused kernel (``sparse_attn_fused.py``: one program per query row,
64-head block and split of the key list, the same arguments, ``sparse_attn_args.py``; split
launches write the partials of ``sparse_attn_combine.py``), but the program's warps specialise so
that gathering and dequantising keys overlaps the tensor cores:

* a producer partition (4 warps, 120 registers) walks the key blocks: it gathers ``BLOCK_N``
  MODEL1 entries by slot, dequantises the 7 fp8 tiles (the rope tile is bf16 already) into a
  bf16 ``[BLOCK_N, 512]`` slot of a shared-memory ring, stores the keys' valid flags next to it
  and signals ``ready[slot]``. Its gather latency is what the consumers wait for (``ncu``), so it
  loads the next block's slot ids while gathering the current one, issues all of a block's
  loads before converting any, and on long lists prefetches the entries two blocks ahead into L2;
* the default partition (8 warps: two consumer warpgroups) waits for ``ready[slot]``, computes
  ``S = Q K^T`` with ``wgmma`` (Q staged once in shared memory; S split by keys across the two
  warpgroups), the online softmax in base 2, ``O += P K`` (P from registers; the fp32 ``[64, 512]``
  accumulator split by columns, 256 per warpgroup) and signals ``empty[slot]``.

Needs Gluon (``triton.experimental.gluon``) as in Triton 3.6 and an sm_90 GPU (``wgmma``,
``setmaxnreg``). Gluon is experimental and its API moves between releases (3.7 renamed
``thread_barrier``), so other Triton versions use the Triton kernels until this one is verified
on them. There is no interpreter path: it is tested on the GPU only (``tests/gpu``), against the
fp64 golden and the fused kernel.

Gluon functions cannot call ``@triton.jit`` ones, so this module restates in Gluon the pieces of
``primitives.py`` / ``sparse_attn_combine.py`` it needs (the slot -> entry addressing, the ue8m0
scale, the online-softmax update, the row epilogues, the partial index); each copy says which.

Shape legend: T = query rows, H = heads, S = splits.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import triton
import triton.language as tl

from .host import INTERPRET
from .primitives import DATA_BYTES, DIM, LN2, LOG2E, NOPE, NUM_NOPE_TILES, ROPE, SCALE_BYTES, TILE
from .sparse_attn_args import key_width, row_kernel_args
from .sparse_attn_combine import Partials, split_count

if TYPE_CHECKING:
    from ...attention import KVSet

try:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, warpgroup_mma,
                                                                  warpgroup_mma_wait)
except ImportError:  # a Triton without Gluon: the other paths serve
    gluon = None

HEAD_BLOCK = 64  # heads per program (fewer are padded): one wgmma M
_PRODUCER_WARPS = 4
_PREFETCH_MIN_KEYS = 2048  # L2 prefetch pays from about 32 blocks per split (c128 @1M: 7 %), costs below
_L2_LINE = tl.constexpr(128)  # bytes
# prefetch addresses per entry: every line of its data bytes, one more for an entry that starts
# inside a line (the last data byte), then the scale bytes
_DATA_LINES = tl.constexpr(-(-DATA_BYTES.value // _L2_LINE.value) + 1)


@dataclass(frozen=True)
class WarpSpecializedConfig:
    """Tuning knobs of the warp-specialised kernel (benchmarks); the defaults are the ones tested
    on the H200."""

    block_n: int = 64  # keys per ring slot
    stages: int = 2  # ring slots: 2 x 64 KB of bf16 keys + 64 KB of q fill the shared memory
    producer_regs: int = 120  # holds a block's raw bytes (72 registers) and the next block's slots unspilled
    max_regs: int = 168  # per thread over all 12 warps (65536 / 384, rounded down to a multiple of 8)
    prefetch: bool | None = None  # L2 prefetch two blocks ahead; None: when a split holds _PREFETCH_MIN_KEYS


VERIFIED_TRITON = "3.6."  # the Gluon API this module is written and tested against


@functools.lru_cache(maxsize=None)
def available(device: torch.device) -> bool:
    """Gluon importable from a verified Triton, compiled kernels (not the interpreter) and an
    sm_90 GPU."""
    return (gluon is not None and triton.__version__.startswith(VERIFIED_TRITON) and not INTERPRET
            and device.type == "cuda" and torch.cuda.get_device_capability(device)[0] == 9)


if gluon is not None:
    @gluon.jit
    def _list_slots(swa_idx_row, ex_idx_row, pos, n_swa, hi, HAS_EXTRA: gl.constexpr):
        """Slot ids at positions ``pos`` of the row's key list (the SWA list, then the extra
        list from ``n_swa``); -1 at and past ``hi``. One load through a selected pointer: nothing
        waits for the value until it is used (a select of two loads would)."""
        ptrs = swa_idx_row + pos
        if HAS_EXTRA:
            ptrs = gl.where(pos < n_swa, ptrs, ex_idx_row + (pos - n_swa))
        return gl.load(ptrs, mask=pos < hi, other=-1)

    @gluon.jit
    def _entry_ptrs(slot, in_swa, swa, ex, SWA_P: gl.constexpr, EX_P: gl.constexpr, HAS_EXTRA: gl.constexpr):
        """Slots (of the SWA cache where ``in_swa``, else the extra cache) -> (entry data
        pointer, scale-bytes pointer, valid); invalid slots point at slot 0. swa / ex: the lists'
        ``sparse_attn_args.EntryList`` tuples. Gluon copy of the addressing in
        ``primitives.gather_entries``."""
        valid = (slot >= 0) & (slot < gl.where(in_swa, swa.capacity, ex.capacity))
        slot = gl.where(valid, slot, 0)
        base = swa.cache + (slot // SWA_P).to(gl.int64) * swa.page_stride
        data = base + (slot % SWA_P) * DATA_BYTES
        scales = base + SWA_P * DATA_BYTES + (slot % SWA_P) * SCALE_BYTES
        if HAS_EXTRA:
            ex_base = ex.cache + (slot // EX_P).to(gl.int64) * ex.page_stride
            data = gl.where(in_swa, data, ex_base + (slot % EX_P) * DATA_BYTES)
            scales = gl.where(in_swa, scales, ex_base + EX_P * DATA_BYTES + (slot % EX_P) * SCALE_BYTES)
        return data, scales, valid

    @gluon.jit
    def _prefetch_l2(ptrs):
        """``prefetch.global.L2`` at each address (no result; asm with a side effect is kept)."""
        gl.inline_asm_elementwise(asm="prefetch.global.L2 [$1];\n mov.u32 $0, 0;", constraints="=r,l",
                                  args=[ptrs], dtype=gl.int32, is_pure=False, pack=1)

    @gluon.jit
    def _prefetch_block(slot, pos, n_swa, swa, ex, SWA_P: gl.constexpr, EX_P: gl.constexpr,
                        HAS_EXTRA: gl.constexpr, PL: gl.constexpr):
        """Pull a block's entries into L2: the 576 data bytes (5 lines, plus the last byte for
        entries that straddle a sixth) and the scale bytes. ``slot`` / ``pos``: [BLOCK] in
        ``SliceLayout(1, PL)``, PL a [BLOCK, 8] layout."""
        data, scales, valid = _entry_ptrs(slot, pos < n_swa, swa, ex, SWA_P, EX_P, HAS_EXTRA)
        c = gl.arange(0, 8, layout=gl.SliceLayout(0, PL))
        lines = gl.where(c[None, :] < _DATA_LINES, data[:, None] + gl.minimum(c * _L2_LINE, DATA_BYTES - 1)[None, :],
                         scales[:, None])
        _prefetch_l2(lines)

    @gluon.jit
    def _producer(k_ring, valid_ring, ready, empty, row, lo, hi, n_swa, swa, ex,
                  SWA_P: gl.constexpr, EX_P: gl.constexpr, HAS_EXTRA: gl.constexpr, BLOCK: gl.constexpr,
                  STAGES: gl.constexpr, PREFETCH: gl.constexpr):
        """Keys ``[lo, hi)`` of ``row``, BLOCK per ring slot: gather, dequantise, signal.

        The gather latency is the producer's critical path, so it runs ahead: the slot ids of
        block j+1 are loaded while block j is gathered, and block j+2's entries are prefetched
        into L2 after block j is stored."""
        KL: gl.constexpr = gl.BlockedLayout([1, 16], [8, 4], [4, 1], [1, 0])  # [BLOCK, 64] bytes
        RL: gl.constexpr = gl.BlockedLayout([1, 8], [8, 4], [4, 1], [1, 0])  # [BLOCK, 64] bf16
        PL: gl.constexpr = gl.BlockedLayout([1, 2], [16, 2], [4, 1], [1, 0])  # [BLOCK, 8] prefetch lines
        cols = gl.arange(0, TILE, layout=gl.SliceLayout(0, KL))
        rope_cols = gl.arange(0, ROPE, layout=gl.SliceLayout(0, RL))
        swa_idx_row = swa.indices + row * swa.index_stride
        ex_idx_row = ex.indices + row * ex.index_stride
        block_pos = gl.arange(0, BLOCK, layout=gl.SliceLayout(1, KL))
        pf_pos = gl.arange(0, BLOCK, layout=gl.SliceLayout(1, PL))
        slot = _list_slots(swa_idx_row, ex_idx_row, lo + block_pos, n_swa, hi, HAS_EXTRA)
        if PREFETCH:
            _prefetch_block(_list_slots(swa_idx_row, ex_idx_row, lo + BLOCK + pf_pos, n_swa, hi, HAS_EXTRA),
                            lo + BLOCK + pf_pos, n_swa, swa, ex, SWA_P, EX_P, HAS_EXTRA, PL)
        for j in range(gl.cdiv(hi - lo, BLOCK)):
            start = lo + j * BLOCK
            data, scales, valid = _entry_ptrs(slot, start + block_pos < n_swa, swa, ex, SWA_P, EX_P, HAS_EXTRA)
            words = scales.to(gl.pointer_type(gl.int32))  # scale bytes 0-3, 4-7
            s_lo = gl.load(words, mask=valid, other=0)
            s_hi = gl.load(words + 1, mask=valid, other=0)
            raws = ()  # all 7 fp8 tiles in flight before the first conversion
            for t in gl.static_range(NUM_NOPE_TILES):
                raws = raws + (gl.load(data[:, None] + (cols + t * TILE)[None, :], mask=valid[:, None], other=0),)
            rope = gl.convert_layout((data + NOPE).to(gl.pointer_type(gl.bfloat16)), gl.SliceLayout(1, RL))
            rope_ok = gl.convert_layout(valid, gl.SliceLayout(1, RL))
            rope_vals = gl.load(rope[:, None] + rope_cols[None, :], mask=rope_ok[:, None], other=0.0)
            slot = _list_slots(swa_idx_row, ex_idx_row, start + BLOCK + block_pos, n_swa, hi, HAS_EXTRA)
            if PREFETCH:
                pf_slot = _list_slots(swa_idx_row, ex_idx_row, start + 2 * BLOCK + pf_pos, n_swa, hi, HAS_EXTRA)
            buf = j % STAGES
            mbarrier.wait(empty.index(buf), ((j // STAGES) & 1) ^ 1)  # a fresh barrier passes parity 1
            keys = k_ring.index(buf)
            for t in gl.static_range(NUM_NOPE_TILES):
                if t < 4:
                    e = (s_lo >> (8 * t)) & 0xFF
                else:
                    e = (s_hi >> (8 * (t - 4))) & 0xFF
                scale = (e << 23).to(gl.float32, bitcast=True)  # primitives.ue8m0_to_fp32: 2^(e-127)
                tile = raws[t].to(gl.float8e4nv, bitcast=True).to(gl.float32) * scale[:, None]
                keys.slice(t * TILE, TILE, dim=1).store(tile.to(gl.bfloat16))
            keys.slice(NOPE, ROPE, dim=1).store(rope_vals)
            valid_ring.index(buf).store(valid.to(gl.int8))
            fence_async_shared()  # generic-proxy stores before the consumers' wgmma reads
            mbarrier.arrive(ready.index(buf), count=1)
            if PREFETCH:
                _prefetch_block(pf_slot, start + 2 * BLOCK + pf_pos, n_swa, swa, ex, SWA_P, EX_P, HAS_EXTRA, PL)

    @gluon.jit
    def _consumer(q_smem, k_ring, valid_ring, ready, empty, lo, hi, qk_scale,
                  HEADS: gl.constexpr, BLOCK: gl.constexpr, STAGES: gl.constexpr):
        """Online softmax attention over the ring -> (acc [HEADS, 512] fp32, m2, l) (base 2). The
        update is ``primitives.softmax_rescale``'s, in Gluon."""
        MMA_S: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 2],
                                                        instr_shape=[16, BLOCK // 2, 16])
        MMA_O: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 2],
                                                        instr_shape=[16, DIM // 2, 16])  # columns per warpgroup
        P_OPERAND: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=MMA_O, k_width=2)
        m2 = gl.full((HEADS,), float("-inf"), gl.float32, layout=gl.SliceLayout(1, MMA_S))
        l = gl.zeros((HEADS,), gl.float32, layout=gl.SliceLayout(1, MMA_S))
        acc = gl.zeros((HEADS, DIM), gl.float32, layout=MMA_O)
        s_init = gl.zeros((HEADS, BLOCK), gl.float32, layout=MMA_S)
        for j in range(gl.cdiv(hi - lo, BLOCK)):
            slot = j % STAGES
            mbarrier.wait(ready.index(slot), (j // STAGES) & 1)
            keys = k_ring.index(slot)
            s = warpgroup_mma(q_smem, keys.permute((1, 0)), s_init, use_acc=False, is_async=True)
            s = warpgroup_mma_wait(num_outstanding=0, deps=(s,))
            valid = valid_ring.index(slot).load(gl.SliceLayout(0, MMA_S))
            s2 = gl.where(valid[None, :] != 0, s * qk_scale, float("-inf"))
            m_new = gl.maximum(m2, gl.max(s2, 1))
            m_safe = gl.where(m_new == float("-inf"), 0.0, m_new)  # no valid key yet: p = 0, no NaN
            alpha = gl.exp2(m2 - m_safe)
            p = gl.exp2(s2 - m_safe[:, None])
            l = l * alpha + gl.sum(p, 1)
            m2 = m_new
            acc = acc * gl.convert_layout(alpha, gl.SliceLayout(1, MMA_O))[:, None]
            acc = warpgroup_mma(gl.convert_layout(p.to(gl.bfloat16), P_OPERAND), keys, acc, is_async=True)
            acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
            mbarrier.arrive(empty.index(slot), count=1)  # after both warpgroups' wgmma read the slot
        return acc, m2, l

    @gluon.jit
    def _sparse_attn_warp_specialized(
        q, stride_qt, stride_qh, swa, ex, sink, out, lse, part_out, part_lse, num_heads, num_splits, softmax_scale,
        SWA_P: gl.constexpr, EX_P: gl.constexpr, HAS_EXTRA: gl.constexpr, SPLIT: gl.constexpr,
        NUM_HEAD_BLOCKS: gl.constexpr, HEADS: gl.constexpr, BLOCK: gl.constexpr, STAGES: gl.constexpr,
        PRODUCER_WARPS: gl.constexpr, PRODUCER_REGS: gl.constexpr, PREFETCH: gl.constexpr,
    ):
        """Grid ``(T * NUM_HEAD_BLOCKS, S)``, 8 warps (+ the producer's); arguments as
        ``sparse_attn_args.row_kernel_args`` (swa / ex: the lists' ``EntryList`` tuples). Outputs
        as ``sparse_attn_fused._sparse_attn_fused``: out / lse, or with SPLIT the partials of
        ``sparse_attn_combine.py``."""
        QL: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [8, 1], [1, 0])  # [HEADS, 512] bf16, 8 warps
        SMEM: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)
        MMA_O: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 2],
                                                        instr_shape=[16, DIM // 2, 16])
        row = (gl.program_id(0) // NUM_HEAD_BLOCKS).to(gl.int64)
        head_block = gl.program_id(0) % NUM_HEAD_BLOCKS
        split = gl.program_id(1)
        # primitives.row_key_counts, in Gluon
        n_swa = gl.minimum(gl.maximum(gl.load(swa.lengths + row), 0), swa.width).to(gl.int32)
        n_all = n_swa
        if HAS_EXTRA:
            n_all += gl.minimum(gl.maximum(gl.load(ex.lengths + row), 0), ex.width).to(gl.int32)
        chunk = gl.cdiv(gl.cdiv(n_all, num_splits), BLOCK) * BLOCK
        lo = split * chunk
        hi = gl.minimum(lo + chunk, n_all)

        q_smem = gl.allocate_shared_memory(gl.bfloat16, [HEADS, DIM], SMEM)
        k_ring = gl.allocate_shared_memory(gl.bfloat16, [STAGES, BLOCK, DIM], SMEM)
        valid_ring = gl.allocate_shared_memory(gl.int8, [STAGES, BLOCK], gl.SwizzledSharedLayout(1, 1, 1, [0]))
        ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        for i in gl.static_range(STAGES):
            mbarrier.init(ready.index(i), count=1)
            mbarrier.init(empty.index(i), count=1)
        q_heads = head_block * HEADS + gl.arange(0, HEADS, layout=gl.SliceLayout(1, QL))
        q_cols = gl.arange(0, DIM, layout=gl.SliceLayout(0, QL))
        q_smem.store(gl.load(q + row * stride_qt + q_heads[:, None] * stride_qh + q_cols[None, :],
                             mask=(q_heads < num_heads)[:, None], other=0.0))
        fence_async_shared()
        gl.thread_barrier()

        acc, m2, l = gl.warp_specialize([
            (_consumer, (q_smem, k_ring, valid_ring, ready, empty, lo, hi, softmax_scale * LOG2E,
                         HEADS, BLOCK, STAGES)),
            (_producer, (k_ring, valid_ring, ready, empty, row, lo, hi, n_swa, swa, ex,
                         SWA_P, EX_P, HAS_EXTRA, BLOCK, STAGES, PREFETCH)),
        ], [PRODUCER_WARPS], [PRODUCER_REGS])

        rows_layout: gl.constexpr = gl.SliceLayout(1, MMA_O)
        m2 = gl.convert_layout(m2, rows_layout)
        l = gl.convert_layout(l, rows_layout)
        heads = head_block * HEADS + gl.arange(0, HEADS, layout=rows_layout)
        head_ok = heads < num_heads
        cols = gl.arange(0, DIM, layout=gl.SliceLayout(0, MMA_O))
        # primitives.finish_rows / sparse_attn_combine.finish_partial_rows and partial_index, in Gluon
        no_keys = l == 0.0
        lse2 = gl.where(no_keys, 0.0, m2 + gl.log2(l))
        if not SPLIT:
            gate = 1.0 / (1.0 + gl.exp2(gl.load(sink + heads, mask=head_ok, other=0.0) * LOG2E - lse2))
            scale = gl.where(no_keys, 0.0, gate / l)
            gl.store(lse + row * num_heads + heads, gl.where(no_keys, float("inf"), lse2 * LN2), mask=head_ok)
            gl.store(out + (row * num_heads + heads)[:, None] * DIM + cols[None, :],
                     (acc * scale[:, None]).to(gl.bfloat16), mask=head_ok[:, None])
        else:
            scale = gl.where(no_keys, 0.0, 1.0 / l)
            part = (row * num_splits + split) * num_heads + heads
            gl.store(part_lse + part, gl.where(no_keys, float("-inf"), lse2), mask=head_ok)
            gl.store(part_out + part[:, None] * DIM + cols[None, :], acc * scale[:, None], mask=head_ok[:, None])


def launch_warp_specialized(q: torch.Tensor, swa: KVSet, extra: KVSet | None, attn_sink: torch.Tensor,
                            softmax_scale: float, out: torch.Tensor, lse: torch.Tensor, partials: Partials | None,
                            config: WarpSpecializedConfig) -> None:
    """The fused kernel's work, warp-specialised: fills out / lse, or with ``partials`` (several
    splits, counted in ``config.block_n``-key blocks) the partial buffers. Inputs as normalised
    by ``sparse_attn_args.normalize``."""
    args, consts = row_kernel_args(q, swa, extra, attn_sink, softmax_scale, out, lse, partials)
    head_blocks = triton.cdiv(q.shape[1], HEAD_BLOCK)
    splits = split_count(partials)
    prefetch = config.prefetch
    if prefetch is None:
        prefetch = key_width(swa, extra) >= _PREFETCH_MIN_KEYS * splits
    _sparse_attn_warp_specialized[(q.shape[0] * head_blocks, splits)](
        *args, **consts, NUM_HEAD_BLOCKS=head_blocks, HEADS=HEAD_BLOCK, BLOCK=config.block_n, STAGES=config.stages,
        PRODUCER_WARPS=_PRODUCER_WARPS, PRODUCER_REGS=config.producer_regs, PREFETCH=prefetch, num_warps=8,
        maxnreg=config.max_regs)
