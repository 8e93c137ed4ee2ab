"""Compiling a step: the whole stack as one graph, with CUDA graphs and the dsv4 FX passes.

:func:`compile_step` is ``torch.compile`` of the stack's step with ``fullgraph=True``, dynamic
request and token counts, CUDA graphs (``triton.cudagraphs``, what ``mode="reduce-overhead"``
sets; a no-op on CPU) and the dsv4 passes as Inductor's ``post_grad_custom_post_pass``. CUDA-graph
trees record one graph per distinct input shape and replay it whenever that shape comes back; the
step's metadata is recomputed inside the graph from the step tensors, so nothing else has to be
copied, refreshed or kept per bucket. Padding the request and token counts up to a few bucket
sizes (``step.REQUEST_BUCKETS`` / ``step.TOKEN_BUCKETS``) bounds the number of recorded graphs.

Frames (docs/compile.md, "Frames and the recompile limit"): every forward mode traces the same
graph on a given stack, so the compiled step hands Dynamo one mode (:data:`GRAPH_MODE`); request
and token counts are dynamic from the first call, so only Dynamo's 0/1 specialisations remain:
at most :data:`MAX_FRAMES` frames per ``compile_step`` call, within torch's default
``recompile_limit`` (8), which each call has to itself.
"""

from __future__ import annotations

import types
from collections.abc import Callable, Mapping
from typing import Any

import torch
import torch._dynamo

from .device_checks import ENABLED_BY_ENV
from .fx_passes import DSV4PassManager
from .layer import DSV4AttentionStack, require_inference
from .model import ModelBackend
from .step import ForwardMode, StepInputs

GRAPH_MODE = ForwardMode.EXTEND
# request count in {0 (idle), 1, >= 2} x token rows in {1, >= 2}; a step with no rows is not compiled
MAX_FRAMES = 6
_CUDA_GRAPHS, _POST_PASS = "triton.cudagraphs", "post_grad_custom_post_pass"
# A step's floats (norm eps, scales) are model constants. Traced as literals, not as the 0-dim CPU
# float64 graph inputs dynamic=True makes of them, they are what the FX passes match (the Sinkhorn
# eps) and add no CPU inputs to the graph. Dynamo reads the setting while it traces, inside a
# call, so every call sets it, with the low-overhead patcher Dynamo itself uses for ``dynamic=``.
_SPECIALIZE_FLOATS = torch._dynamo.config._make_closure_patcher(specialize_float=True)


def compile_options(mode: str | None = None, options: Mapping[str, Any] | None = None,
                    cuda_graphs: bool | None = None, passes: DSV4PassManager | None = None) -> dict[str, Any]:
    """The Inductor options :func:`compile_step` compiles with: ``mode``'s options
    (``torch._inductor.list_mode_options``), updated by ``options``, then what the step needs
    where they leave it open: CUDA graphs on unless ``cuda_graphs``, ``options`` or a
    ``*-no-cudagraphs`` mode say otherwise (a contradiction raises), and ``passes`` (default: every dsv4 pass) as the post-grad
    custom pass, a slot ``options`` may not take (torch 2.11 accepts a single pass there)."""
    try:
        merged = dict(torch._inductor.list_mode_options(mode)) if mode else {}
    except (KeyError, RuntimeError):  # torch 2.11 / 2.13
        raise ValueError(f"mode={mode!r}: expected one of {list(torch._inductor.list_mode_options())}") from None
    if mode and mode.endswith("-no-cudagraphs"):  # says so by its name only
        merged[_CUDA_GRAPHS] = False
    merged.update(options or {})
    if _POST_PASS in merged:
        raise ValueError(f"options[{_POST_PASS!r}] would replace the dsv4 passes: pass "
                         "passes=DSV4PassManager([...]) with every pass to run instead")
    if cuda_graphs is None:
        merged.setdefault(_CUDA_GRAPHS, True)
    elif merged.get(_CUDA_GRAPHS, cuda_graphs) != cuda_graphs:
        raise ValueError(f"cuda_graphs={cuda_graphs} contradicts {_CUDA_GRAPHS}={merged[_CUDA_GRAPHS]} "
                         f"from mode={mode!r} / options")
    else:
        merged[_CUDA_GRAPHS] = cuda_graphs
    merged[_POST_PASS] = DSV4PassManager() if passes is None else passes
    return merged


def compile_step(stack: DSV4AttentionStack | ModelBackend, *, mode: str | None = None, options: Mapping[str, Any] | None = None,
                 backend: str | Callable | None = "inductor", dynamic: bool | None = True, fullgraph: bool = True,
                 cuda_graphs: bool | None = None, passes: DSV4PassManager | None = None,
                 device_checks: bool | None = None, **kwargs) -> "CompiledStep":
    """``step_fn(x, step)``: ``stack``'s step compiled as one graph. ``stack`` is an attention stack
    or a model on the backend (:class:`~dsv4_compile.model.ModelBackend`, whose step is
    ``step_fn(input_ids, step, logit_rows)``).

    Takes ``torch.compile``'s arguments: ``mode`` and ``options`` together (the mode's options,
    updated by ``options``; see :func:`compile_options`, which also adds ``cuda_graphs`` and
    ``passes``); ``dynamic`` (default True: request and token counts do not recompile; False
    compiles a frame per distinct shape, beyond :data:`MAX_FRAMES`); ``fullgraph``; any other
    keyword (``name``, ``disable``, ...) as is. With a ``backend`` other than Inductor, ``mode``
    and ``options`` go to it unchanged and ``cuda_graphs`` / ``passes`` (Inductor settings) must
    be left unset. ``device_checks``: see :mod:`dsv4_compile.device_checks` (``None``: the
    ``DSV4_DEVICE_CHECKS`` environment switch); on a CPU stack they compile Inductor's kernels
    single-threaded (``cpp.threads=1``): a failed check throws inside a kernel, and from an
    OpenMP parallel region that terminates the process instead of raising."""
    checks = ENABLED_BY_ENV if device_checks is None else device_checks
    backend = backend or "inductor"  # torch.compile's default
    if backend == "inductor":
        if checks and stack.cache.device.type == "cpu":  # a failed check must raise, not terminate
            options = {"cpp.threads": 1, **(options or {})}
        settings = {"options": compile_options(mode, options, cuda_graphs, passes)}
    elif cuda_graphs is not None or passes is not None:
        raise ValueError(f"cuda_graphs and passes are Inductor settings; backend={backend!r} takes neither")
    else:
        settings = {"mode": mode, "options": dict(options) if options else None}
    compiled = torch.compile(_own_code(_run_step), backend=backend, dynamic=dynamic, fullgraph=fullgraph,
                             **settings, **kwargs)
    return CompiledStep(stack, compiled, checks)


class CompiledStep:
    """What :func:`compile_step` returns: ``step_fn(x [T, hidden] bf16, step) -> [T, hidden] bf16``.

    Before entering the compiled graph, on the host and from Python values only: refuses a step
    under autograd and ``DRAFT_EXTEND`` on a stack with compressed layers (what eager validation
    would say), returns a step with no rows at once (it computes and writes nothing), and hands
    Dynamo the step in one canonical form (:func:`_graph_step`), with the floats it meets
    specialised (traced as constants). Outputs of a CUDA-graph replay
    are overwritten by the next replay: clone what you keep.
    """

    def __init__(self, stack: DSV4AttentionStack | ModelBackend, compiled: Callable, device_checks: bool):
        self.stack, self.compiled, self.device_checks = stack, compiled, device_checks
        self._compresses = any(stack.config.compress_ratios)

    def __call__(self, x: torch.Tensor, step: StepInputs, *extra: torch.Tensor) -> torch.Tensor:
        require_inference(self.stack, x)
        if step.mode is ForwardMode.DRAFT_EXTEND and self._compresses:
            raise ValueError("step.mode: DRAFT_EXTEND is for SWA-only (draft) stacks; this stack has "
                             "compressed layers")
        if step.num_tokens == 0:
            return self.stack.empty_output(x, *extra)
        revert = _SPECIALIZE_FLOATS()
        try:
            return self.compiled(self.stack, _plain(x), _graph_step(step), tuple(_plain(t) for t in extra),
                                 self.device_checks)
        finally:
            revert()


def _graph_step(step: StepInputs) -> StepInputs:
    """``step`` as the compiled function receives it: mode :data:`GRAPH_MODE`, no views, and with
    no request its three empty request tensors as one, the way ``StepInputs.idle`` builds it
    (Dynamo guards on views and on aliasing, each a frame of its own otherwise)."""
    rows, seq_lens, extend_lens, loc = (_plain(t) for t in step.tensors())
    if not rows.shape[0]:
        seq_lens = extend_lens = rows
    return StepInputs(GRAPH_MODE, rows, seq_lens, extend_lens, loc)


def _plain(t: torch.Tensor) -> torch.Tensor:
    """``t``, or when it is a view, the same memory as a tensor that is not a view."""
    return t if t._base is None else t.detach()


def _run_step(stack: DSV4AttentionStack | ModelBackend, x: torch.Tensor, step: StepInputs,
              extra: tuple[torch.Tensor, ...], device_checks: bool) -> torch.Tensor:
    return stack(x, step, *extra, device_checks=device_checks)


def _own_code(fn: types.FunctionType) -> types.FunctionType:
    """A copy of ``fn`` with a code object of its own. Dynamo keeps compiled frames and counts
    ``recompile_limit`` per code object, so each compiled step gets its own frames and limit:
    a target and a draft stack compiled side by side do not add up."""
    return types.FunctionType(fn.__code__.replace(), fn.__globals__, fn.__name__, fn.__defaults__,
                              fn.__closure__)
