"""Eager validation at the public boundary, before anything is written.

:meth:`DSV4AttentionStack.forward <dsv4_compile.layer.DSV4AttentionStack.forward>` calls
:func:`validate_step` on every eager call (unless ``validate=False``). It reads values on the
host, so a compiled step never runs it: there only the ops' own shape / dtype checks apply (at
trace time), and the values in a step's tensors are not checked.
"""

from __future__ import annotations

import torch

from .cache import DSV4Cache
from .config import PAGE_SIZE, DSV4AttnConfig
from .step import ForwardMode, StepInputs, check_step

_INT = (torch.int32, torch.int64)
_STEP_TENSORS = ("req_rows", "seq_lens", "extend_lens", "out_cache_loc")


def _fail(name: str, why: str) -> None:
    raise ValueError(f"step.{name}: {why}")


def _check_index_tensor(name: str, t, device: torch.device) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"step.{name} must be a Tensor, got {type(t).__name__}")
    if t.dtype not in _INT:
        raise TypeError(f"step.{name} must be one of {_INT}, got {t.dtype}")
    if t.dim() != 1:
        _fail(name, f"must be 1-D, got shape {tuple(t.shape)}")
    if t.device != device:
        _fail(name, f"is on {t.device}, the cache is on {device}")


def _check_x(config: DSV4AttnConfig, cache: DSV4Cache, x, num_tokens: int) -> None:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"x must be a bfloat16 Tensor, got {type(x).__name__}")
    if x.device != cache.device:
        raise ValueError(f"x is on {x.device}, the cache is on {cache.device}")
    if x.dtype != torch.bfloat16:
        raise TypeError(f"x must be a bfloat16 Tensor, got {x.dtype}")
    if x.dim() != 2 or x.shape != (num_tokens, config.hidden_size):
        raise ValueError(f"x has shape {tuple(x.shape)}, expected ({num_tokens}, {config.hidden_size}) "
                         "(one row per out_cache_loc entry)")


def validate_step(config: DSV4AttnConfig, cache: DSV4Cache, x: torch.Tensor, step: StepInputs) -> None:
    """Check ``x [T, hidden] bf16`` and ``step`` against the cache and its index maps; raise
    ValueError / TypeError naming the offending argument. Reads nothing but the step, ``x``'s
    metadata and ``req_to_token``; writes nothing."""
    check_step(step)
    if not isinstance(step.mode, ForwardMode):
        raise TypeError(f"step.mode must be a ForwardMode, got {type(step.mode).__name__}")
    for name in _STEP_TENSORS:
        _check_index_tensor(name, getattr(step, name), cache.device)
    _check_x(config, cache, x, step.num_tokens)
    b = step.batch_size
    if step.seq_lens.shape[0] != b or step.extend_lens.shape[0] != b:
        _fail("seq_lens", f"req_rows, seq_lens and extend_lens need the same length, got "
                          f"{b}, {step.seq_lens.shape[0]}, {step.extend_lens.shape[0]}")
    if step.mode is ForwardMode.IDLE and b:
        _fail("req_rows", "must be empty in IDLE mode")
    if step.mode is ForwardMode.DRAFT_EXTEND and any(config.compress_ratios):
        _fail("mode", "DRAFT_EXTEND is for SWA-only (draft) stacks; this stack has compressed layers")
    positions = _check_requests(config, cache, step)
    _check_slots(cache, step.out_cache_loc.tolist(), positions)


def _check_requests(config: DSV4AttnConfig, cache: DSV4Cache, step: StepInputs) -> list[tuple[int, int]]:
    """Per-request checks; returns the (request row, position) of every real token row, in order."""
    rows, seqs, exts = (v.tolist() for v in (step.req_rows, step.seq_lens, step.extend_lens))
    if sum(exts) > step.num_tokens:
        _fail("out_cache_loc", f"has {step.num_tokens} rows but extend_lens sum to {sum(exts)}")
    live = [r for r in rows if r != 0]
    if len(set(live)) != len(live):
        _fail("req_rows", f"a request row appears twice: {rows}")
    positions = []
    for b, (row, seq, ext) in enumerate(zip(rows, seqs, exts)):
        if not 0 <= row <= cache.max_requests:
            _fail("req_rows", f"[{b}]={row} outside [0, {cache.max_requests}]")
        if not 0 <= ext <= seq:
            _fail("extend_lens", f"[{b}]={ext} must be in [0, seq_lens[{b}]={seq}]")
        if seq > cache.max_seq_len:
            _fail("seq_lens", f"[{b}]={seq} exceeds the cache's max_seq_len {cache.max_seq_len}")
        if step.mode is ForwardMode.DECODE and ext not in (0, 1):
            _fail("extend_lens", f"[{b}]={ext}: decode processes one token per request")
        if step.mode is ForwardMode.TARGET_VERIFY and ext > config.max_draft_tokens:
            _fail("extend_lens", f"[{b}]={ext}: a verify step takes at most max_draft_tokens="
                                 f"{config.max_draft_tokens} tokens per request (the compressor rings "
                                 "hold no more)")
        if row == 0 and ext:
            _fail("req_rows", f"[{b}] is the dummy row 0 but has {ext} tokens")
        positions += [(row, p) for p in range(seq - ext, seq)]
    return positions


def _check_slots(cache: DSV4Cache, loc: list[int], positions: list[tuple[int, int]]) -> None:
    """``out_cache_loc`` holds, on each real row, the slot ``req_to_token`` gives its (request row,
    position) — a non-zero slot, so the position is allocated to a live request — and 0 on the
    padding rows after them."""
    capacity = cache.num_full_pages * PAGE_SIZE
    for i, slot in enumerate(loc):
        if not 0 <= slot < capacity:
            _fail("out_cache_loc", f"[{i}]={slot} outside the full pool [0, {capacity})")
        if i >= len(positions) and slot != 0:
            _fail("out_cache_loc", f"[{i}]={slot}: padding rows must hold the dummy slot 0")
    if not positions:
        return
    index = torch.tensor(positions, device=cache.device).t()
    expect = cache.req_to_token[index[0], index[1]].tolist()
    for i, ((row, pos), got, want) in enumerate(zip(positions, loc, expect)):
        if want == 0:
            _fail("out_cache_loc", f"[{i}]={got}: position {pos} of request row {row} is not allocated "
                                   "(a freed or never-admitted row, or a position past its length; "
                                   "allocate tokens with PageAllocator.extend)")
        if got != want:
            _fail("out_cache_loc", f"[{i}]={got} but req_to_token maps that position to {want} "
                                   "(allocate tokens with PageAllocator.extend)")
