"""Eager validation of a step at the public boundary, before anything is written.

:meth:`DSV4AttentionStack.forward <dsv4_compile.layer.DSV4AttentionStack.forward>` calls it on
every eager call (unless ``validate=False``). It reads values on the host, so a compiled step
never runs it: there only the ops' own shape / dtype checks apply (at trace time), and the values
in a step's tensors are not checked.
"""

from __future__ import annotations

import torch

from .cache import DSV4Cache
from .config import PAGE_SIZE, DSV4AttnConfig
from .step import ForwardMode, StepInputs

_INT = (torch.int32, torch.int64)


def _fail(name: str, why: str) -> None:
    raise ValueError(f"step.{name}: {why}")


def _check_dtype(name: str, t: torch.Tensor, dtypes) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"step.{name} must be a Tensor, got {type(t).__name__}")
    if t.dtype not in dtypes:
        raise TypeError(f"step.{name} must be one of {dtypes}, got {t.dtype}")
    if t.dim() != 1:
        _fail(name, f"must be 1-D, got shape {tuple(t.shape)}")


def validate_step(config: DSV4AttnConfig, cache: DSV4Cache, x: torch.Tensor, step: StepInputs) -> None:
    """Check ``x [T, hidden] bf16`` and ``step`` against the cache; raise ValueError/TypeError
    naming the offending argument."""
    if not isinstance(step, StepInputs):
        raise TypeError(f"step must be a StepInputs, got {type(step).__name__}")
    if not isinstance(x, torch.Tensor) or x.dtype != torch.bfloat16:
        raise TypeError(f"x must be a bfloat16 Tensor, got {getattr(x, 'dtype', type(x).__name__)}")
    t = step.num_tokens
    if x.dim() != 2 or x.shape != (t, config.hidden_size):
        raise ValueError(f"x has shape {tuple(x.shape)}, expected ({t}, {config.hidden_size}) "
                         "(one row per out_cache_loc entry)")
    for name in ("req_rows", "seq_lens", "extend_lens"):
        _check_dtype(name, getattr(step, name), _INT)
    _check_dtype("out_cache_loc", step.out_cache_loc, _INT)
    b = step.batch_size
    if step.seq_lens.shape[0] != b or step.extend_lens.shape[0] != b:
        _fail("seq_lens", f"req_rows, seq_lens and extend_lens need the same length, got "
                          f"{b}, {step.seq_lens.shape[0]}, {step.extend_lens.shape[0]}")
    for name, tensor in zip(("req_rows", "seq_lens", "extend_lens", "out_cache_loc"), step.tensors()):
        if tensor.device != cache.device:
            _fail(name, f"is on {tensor.device}, the cache is on {cache.device}")
    if step.mode is ForwardMode.IDLE and b:
        _fail("req_rows", "must be empty in IDLE mode")
    if step.mode is ForwardMode.DRAFT_EXTEND and any(config.compress_ratios):
        _fail("mode", "DRAFT_EXTEND is for SWA-only (draft) stacks; this stack has compressed layers")
    _check_values(cache, step)


def _check_values(cache: DSV4Cache, step: StepInputs) -> None:
    rows, seqs, exts = (v.tolist() for v in (step.req_rows, step.seq_lens, step.extend_lens))
    loc = step.out_cache_loc.tolist()
    total = sum(exts)
    if total > len(loc):
        _fail("out_cache_loc", f"has {len(loc)} rows but extend_lens sum to {total}")
    live = [r for r in rows if r != 0]
    if len(set(live)) != len(live):
        _fail("req_rows", f"a request row appears twice: {rows}")
    capacity = cache.num_full_pages * PAGE_SIZE
    req_to_token = cache.req_to_token
    pos_rows, pos_cols = [], []
    for b, (row, seq, ext) in enumerate(zip(rows, seqs, exts)):
        if not 0 <= row <= cache.max_requests:
            _fail("req_rows", f"[{b}]={row} outside [0, {cache.max_requests}]")
        if not 0 <= ext <= seq:
            _fail("extend_lens", f"[{b}]={ext} must be in [0, seq_lens[{b}]={seq}]")
        if seq > cache.max_seq_len:
            _fail("seq_lens", f"[{b}]={seq} exceeds the cache's max_seq_len {cache.max_seq_len}")
        if step.mode is ForwardMode.DECODE and ext not in (0, 1):
            _fail("extend_lens", f"[{b}]={ext}: decode processes one token per request")
        if row == 0 and ext:
            _fail("req_rows", f"[{b}] is the dummy row 0 but has {ext} tokens")
        pos_rows += [row] * ext
        pos_cols += range(seq - ext, seq)
    for i, slot in enumerate(loc):
        if not 0 <= slot < capacity:
            _fail("out_cache_loc", f"[{i}]={slot} outside the full pool [0, {capacity})")
        if i >= total and slot != 0:
            _fail("out_cache_loc", f"[{i}]={slot}: padding rows must hold the dummy slot 0")
    if total:
        expect = req_to_token[torch.tensor(pos_rows, device=cache.device),
                              torch.tensor(pos_cols, device=cache.device)].tolist()
        for i, (got, want) in enumerate(zip(loc, expect)):
            if got != want:
                _fail("out_cache_loc", f"[{i}]={got} but req_to_token maps that position to {want} "
                                       "(allocate tokens with PageAllocator.extend)")
