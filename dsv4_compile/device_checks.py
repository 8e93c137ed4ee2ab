"""Optional checks of a step's tensors inside the step itself, for debugging a compiled loop.

A compiled step (``compile_step``, a CUDA graph) never runs the host-side
:func:`~dsv4_compile.validate.validate_step`: reading values on the host would break the graph.
With device checks on (``DSV4AttentionStack.forward(..., device_checks=True)``,
``compile_step(stack, device_checks=True)``, or ``DSV4_DEVICE_CHECKS=1`` in the environment when
``dsv4_compile`` is imported) the step checks its inputs with graph operations instead:

* shapes with ``torch._check`` (at trace time, and as guards of the compiled frame);
* values with ``torch._assert_async`` on conditions computed from the step tensors and the cache's
  index maps: request rows in range and distinct, lengths consistent, every real row's slot in
  the full pool and equal to what ``req_to_token`` maps its position to, padding rows on slot 0.

On CPU a failed assert raises ``RuntimeError`` with the message below; on CUDA it is a device-side
assert (the CUDA context is lost, as with any device assert; run with ``CUDA_LAUNCH_BLOCKING=1``
to see which). A compiler may schedule an assert after later ops, so the layers run on a step
computed from the checks: the step itself, or all padding when a check fails (nothing but the
dummy slot is written). Off (the default), nothing is added to the graph.
"""

from __future__ import annotations

import os

import torch

from .cache import DSV4Cache
from .config import PAGE_SIZE
from .step import StepInputs

ENV_VAR = "DSV4_DEVICE_CHECKS"
ENABLED_BY_ENV = os.environ.get(ENV_VAR, "") not in ("", "0")


def checked_step(cache: DSV4Cache, hidden_size: int, x: torch.Tensor, step: StepInputs) -> StepInputs:
    """Check ``x [T, hidden]`` and ``step`` against ``cache``: shapes with ``torch._check``, values
    with ``torch._assert_async``. Returns the step the layers should run: ``step`` itself when
    every check holds, else all padding (request row 0 with no tokens, slot 0 on every row).
    Computing the step from the checks orders them before every op that reads it, and a device
    that reports a failed assert late writes nothing but the dummy slot meanwhile."""
    rows, seqs, exts, loc = step.tensors()
    t, b = loc.shape[0], rows.shape[0]
    torch._check(x.dim() == 2 and x.shape[1] == hidden_size, lambda: f"x: expected [T, {hidden_size}]")
    torch._check(x.shape[0] == t, lambda: "x: one row per out_cache_loc entry")
    torch._check(seqs.shape[0] == b and exts.shape[0] == b,
                 lambda: "step: req_rows, seq_lens and extend_lens need the same length")
    later = torch.ones(b, b, dtype=torch.bool, device=rows.device).triu(1)
    capacity = cache.num_full_pages * PAGE_SIZE
    total = exts.sum()
    real = torch.arange(t, device=loc.device) < total
    checks = {
        f"step.req_rows: a row outside [0, {cache.max_requests}]": (rows >= 0) & (rows <= cache.max_requests),
        "step.req_rows: a request row appears twice": ~((rows[:, None] == rows[None, :]) & (rows[:, None] != 0)
                                                       & later),
        f"step.extend_lens / seq_lens: need 0 <= extend_lens <= seq_lens <= {cache.max_seq_len}":
            (exts >= 0) & (exts <= seqs) & (seqs <= cache.max_seq_len),
        "step.req_rows: the dummy row 0 has tokens": (rows != 0) | (exts == 0),
        "step.extend_lens: they sum to more than out_cache_loc's rows": total <= t,
        f"step.out_cache_loc: a real row's slot outside [0, {capacity}) or a padding row not on slot 0":
            torch.where(real, (loc >= 0) & (loc < capacity), loc == 0),
        "step.out_cache_loc: a slot that req_to_token does not map to its row's position (allocate tokens "
        "with PageAllocator.extend)": ~real | (_mapped_slots(cache, step) == loc),
    }
    ok = torch.stack([cond.all() for cond in checks.values()]).all()
    for message, cond in checks.items():
        torch._assert_async(cond.all(), message)
    return StepInputs(step.mode, *(torch.where(ok, v, torch.zeros_like(v)) for v in step.tensors()))


def _mapped_slots(cache: DSV4Cache, step: StepInputs) -> torch.Tensor:
    """``[T]``: ``req_to_token`` at each query row's request and position, found from the step
    tensors alone (rows past ``sum(extend_lens)`` get some in-range entry; indices are clamped, so
    a bad step cannot read out of bounds)."""
    rows, seqs, exts, loc = step.tensors()
    t, b = loc.shape[0], rows.shape[0]
    tokens = cache.req_to_token
    if b == 0:  # no request: every row is padding
        return torch.zeros_like(loc)
    ends = torch.cumsum(exts.long(), 0)
    i = torch.arange(t, device=loc.device)
    r = torch.searchsorted(ends, i, right=True).clamp(max=b - 1)
    position = seqs.long()[r] - ends[r] + i
    request = rows.long()[r].clamp(0, tokens.shape[0] - 1)
    return tokens[request, position.clamp(0, tokens.shape[1] - 1)].to(loc.dtype)
