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
to see which). The input checks run before the step writes anything, the slot check after the
metadata ops (which write nothing) and before the first layer. Off (the default), nothing is added
to the graph.
"""

from __future__ import annotations

import os

import torch

from .cache import DSV4Cache
from .config import PAGE_SIZE
from .step import StepInputs, StepMetadata

ENV_VAR = "DSV4_DEVICE_CHECKS"
ENABLED_BY_ENV = os.environ.get(ENV_VAR, "") not in ("", "0")


def check_step_inputs(cache: DSV4Cache, hidden_size: int, x: torch.Tensor, step: StepInputs) -> None:
    """Shapes of ``x [T, hidden]`` and ``step`` (``torch._check``) and the values of the step's
    tensors (``torch._assert_async``) against ``cache``."""
    rows, seqs, exts, loc = step.tensors()
    t, b = loc.shape[0], rows.shape[0]
    torch._check(x.dim() == 2 and x.shape[1] == hidden_size, lambda: f"x: expected [T, {hidden_size}]")
    torch._check(x.shape[0] == t, lambda: "x: one row per out_cache_loc entry")
    torch._check(seqs.shape[0] == b and exts.shape[0] == b,
                 lambda: "step: req_rows, seq_lens and extend_lens need the same length")
    _assert(((rows >= 0) & (rows <= cache.max_requests)).all(),
            f"step.req_rows: a row outside [0, {cache.max_requests}]")
    later = torch.ones(b, b, dtype=torch.bool, device=rows.device).triu(1)
    _assert(~((rows[:, None] == rows[None, :]) & (rows[:, None] != 0) & later).any(),
            "step.req_rows: a request row appears twice")
    _assert(((exts >= 0) & (exts <= seqs) & (seqs <= cache.max_seq_len)).all(),
            f"step.extend_lens / seq_lens: need 0 <= extend_lens <= seq_lens <= {cache.max_seq_len}")
    _assert(((rows != 0) | (exts == 0)).all(), "step.req_rows: the dummy row 0 has tokens")
    total = exts.sum()
    _assert(total <= t, "step.extend_lens: they sum to more than out_cache_loc's rows")
    real = torch.arange(t, device=loc.device) < total
    capacity = cache.num_full_pages * PAGE_SIZE
    _assert(torch.where(real, (loc >= 0) & (loc < capacity), loc == 0).all(),
            f"step.out_cache_loc: a real row's slot outside [0, {capacity}) or a padding row not on slot 0")


def check_step_slots(cache: DSV4Cache, step: StepInputs, meta: StepMetadata) -> None:
    """Every real row's ``out_cache_loc`` equals ``req_to_token`` at the row's request and
    position (the positions the allocator handed out for this step)."""
    tokens, loc = cache.req_to_token, step.out_cache_loc
    request = meta.req_of_row.long().clamp(0, tokens.shape[0] - 1)
    position = meta.positions.long().clamp(0, tokens.shape[1] - 1)
    real = torch.arange(loc.shape[0], device=loc.device) < step.extend_lens.sum()
    mapped = tokens[request, position].to(loc.dtype) == loc
    _assert((mapped | ~real).all(), "step.out_cache_loc: a slot that req_to_token does not map to its "
                                    "row's position (allocate tokens with PageAllocator.extend)")


def _assert(ok: torch.Tensor, message: str) -> None:
    torch._assert_async(ok, message)
