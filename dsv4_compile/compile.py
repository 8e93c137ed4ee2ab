"""Compiling a step: the whole stack as one graph, with CUDA graphs and the dsv4 FX passes.

:func:`compile_step` is ``torch.compile`` of the stack's step with ``fullgraph=True``, dynamic
request and token counts, CUDA graphs (``triton.cudagraphs``, what ``mode="reduce-overhead"``
sets; a no-op on CPU) and the dsv4 passes as Inductor's custom passes (post-grad, and pre-grad
for the rewrites that can run on Dynamo's graph). CUDA-graph trees record one graph per distinct
input shape and replay it whenever that shape comes back; the step's metadata is recomputed
inside the graph from the step tensors, so nothing else has to be copied, refreshed or kept per
bucket. Padding the request and token counts up to a few bucket
sizes (``step.REQUEST_BUCKETS`` / ``step.TOKEN_BUCKETS``) bounds the number of recorded graphs.

Frames (docs/compile.md, "Frames and the recompile limit"): every forward mode traces the same
graph on a given stack, so the compiled step hands Dynamo one mode (:data:`GRAPH_MODE`); request
and token counts are dynamic from the first call, and while Dynamo compiles one of its frames a
compiled step turns off the 0/1 size specialisation and duck sizing (:data:`FRAME_SHAPE_CONFIG`;
floats are traced as constants, :data:`FRAME_DYNAMO_CONFIG`),
so that a first call with one request or one row does not fix that count: at most
:data:`MAX_FRAMES` frames per ``compile_step`` call, within torch's default ``recompile_limit``
(8), which each call has to itself.
"""

from __future__ import annotations

import threading
import types
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch._dynamo.callback import CallbackTrigger
from torch._dynamo.source import LocalSource

from .device_checks import ENABLED_BY_ENV
from .fx_passes import DSV4PassManager
from .layer import DSV4AttentionStack, require_inference
from .model import ModelBackend
from .step import ForwardMode, StepInputs
from .step_graphs import StepGraphs

GRAPH_MODE = ForwardMode.EXTEND
# idle or not (its empty request tensors alias one another); a step with no rows is not compiled
MAX_FRAMES = 2
# Symbolic-shape settings a compiled step's frames are traced with: a size of 1 is not specialised
# (it is reasoned about as any size >= 2 would be) and two inputs of equal size get sizes of their
# own, so one frame serves one request and many, one row and many. What still tells 1 apart is a
# guard the model's own code adds (a reshape whose strides differ for one row): a second frame.
FRAME_SHAPE_CONFIG = {"backed_size_oblivious": True, "use_duck_shape": False}
# Dynamo settings of the same frames: the step's floats (norm eps, scales: model constants) are
# traced as literals, not as the 0-dim CPU float64 graph inputs ``dynamic=True`` makes of them
# on torch 2.13, so that the FX passes can match them (the Sinkhorn eps).
FRAME_DYNAMO_CONFIG = {"specialize_float": True}
_CUDA_GRAPHS, _POST_PASS, _PRE_PASS = "triton.cudagraphs", "post_grad_custom_post_pass", "pre_grad_custom_pass"
# compile_step(cuda_graphs=STEP_GRAPHS): the whole step captured per input signature (step_graphs.py)
STEP_GRAPHS = "step"


def compile_options(mode: str | None = None, options: Mapping[str, Any] | None = None,
                    cuda_graphs: bool | None = None, passes: DSV4PassManager | None = None) -> dict[str, Any]:
    """The Inductor options :func:`compile_step` compiles with: ``mode``'s options
    (``torch._inductor.list_mode_options``), updated by ``options``, then what the step needs
    where they leave it open: CUDA graphs on unless ``cuda_graphs``, ``options`` or a
    ``*-no-cudagraphs`` mode say otherwise (a contradiction raises), and ``passes`` (default:
    ``DSV4PassManager()``, the default pass list) as the post-grad custom pass and, through its
    pre-grad stage, the pre-grad one: slots ``options`` may not take (torch 2.11 accepts a single
    pass in each)."""
    try:
        merged = dict(torch._inductor.list_mode_options(mode)) if mode else {}
    except (KeyError, RuntimeError):  # torch 2.11 / 2.13
        raise ValueError(f"mode={mode!r}: expected one of {list(torch._inductor.list_mode_options())}") from None
    if mode and mode.endswith("-no-cudagraphs"):  # says so by its name only
        merged[_CUDA_GRAPHS] = False
    merged.update(options or {})
    for slot in (_PRE_PASS, _POST_PASS):
        if slot in merged:
            raise ValueError(f"options[{slot!r}] would replace the dsv4 passes: pass "
                             "passes=DSV4PassManager([...]) with every pass to run instead")
    if cuda_graphs is None:
        merged.setdefault(_CUDA_GRAPHS, True)
    elif merged.get(_CUDA_GRAPHS, cuda_graphs) != cuda_graphs:
        raise ValueError(f"cuda_graphs={cuda_graphs} contradicts {_CUDA_GRAPHS}={merged[_CUDA_GRAPHS]} "
                         f"from mode={mode!r} / options")
    else:
        merged[_CUDA_GRAPHS] = cuda_graphs
    merged[_POST_PASS] = DSV4PassManager() if passes is None else passes
    merged[_PRE_PASS] = merged[_POST_PASS].pre_grad_stage()
    return merged


def compile_step(stack: DSV4AttentionStack | ModelBackend, *, mode: str | None = None, options: Mapping[str, Any] | None = None,
                 backend: str | Callable | None = "inductor", dynamic: bool | None = True, fullgraph: bool = True,
                 cuda_graphs: bool | str | None = None, passes: DSV4PassManager | None = None,
                 device_checks: bool | None = None, model_guards: bool = True, **kwargs) -> "CompiledStep":
    """``step_fn(x, step)``: ``stack``'s step compiled as one graph. ``stack`` is an attention stack
    or a model on the backend (:class:`~dsv4_compile.model.ModelBackend`, whose step is
    ``step_fn(input_ids, step, logit_rows)``).

    Takes ``torch.compile``'s arguments: ``mode`` and ``options`` together (the mode's options,
    updated by ``options``; see :func:`compile_options`, which also adds ``cuda_graphs`` and
    ``passes``); ``dynamic`` (default True: request and token counts do not recompile; False
    compiles a frame per distinct shape, beyond :data:`MAX_FRAMES`); ``fullgraph``; any other
    keyword (``name``, ``disable``, ...) as is. With a ``backend`` other than Inductor, ``mode``
    and ``options`` go to it unchanged and ``cuda_graphs`` / ``passes`` (Inductor settings) must
    be left unset. ``cuda_graphs=STEP_GRAPHS`` (``"step"``, any backend) captures the whole compiled
    step as one CUDA graph per input signature and replays it without entering Dynamo
    (:mod:`dsv4_compile.step_graphs`: a few µs of host time a call, under the contract of
    ``model_guards=False`` below); Inductor then compiles without its own CUDA graphs, and on a CPU
    stack it changes nothing. ``device_checks``: see :mod:`dsv4_compile.device_checks` (``None``: the
    ``DSV4_DEVICE_CHECKS`` environment switch); on a CPU stack they compile Inductor's kernels
    single-threaded (``cpp.threads=1``): a failed check throws inside a kernel, and from an
    OpenMP parallel region that terminates the process instead of raising.

    ``model_guards=False`` drops Dynamo's guards on ``stack`` (its modules, their attributes,
    parameters and buffers: ~85 % of a model step's guards, most of the host time a call spends
    before its graph runs; docs/compile.md, "Guards on the model"), keeping those on the step's
    inputs and on globals, so new shapes still compile new frames. The caller promises that
    ``stack`` stays as it was compiled: weights may be updated in place (``copy_``), but a module,
    attribute or parameter replaced by one of another type, shape, dtype or device goes unnoticed."""
    checks = ENABLED_BY_ENV if device_checks is None else device_checks
    backend = backend or "inductor"  # torch.compile's default
    step_graphs = cuda_graphs == STEP_GRAPHS
    if not (cuda_graphs is None or isinstance(cuda_graphs, bool) or step_graphs):
        raise ValueError(f"cuda_graphs={cuda_graphs!r}: expected None, True, False or {STEP_GRAPHS!r}")
    if backend == "inductor":
        if checks and stack.cache.device.type == "cpu":  # a failed check must raise, not terminate
            options = {"cpp.threads": 1, **(options or {})}
        settings = {"options": compile_options(mode, options, None if step_graphs else cuda_graphs, passes)}
        if step_graphs:  # the whole step is captured instead of Inductor's graph trees
            if not settings["options"][_CUDA_GRAPHS]:
                raise ValueError(f"cuda_graphs={STEP_GRAPHS!r} contradicts {_CUDA_GRAPHS}=False from "
                                 f"mode={mode!r} / options")
            settings["options"][_CUDA_GRAPHS] = False
    elif (cuda_graphs is not None and not step_graphs) or passes is not None:
        raise ValueError(f"passes and cuda_graphs other than {STEP_GRAPHS!r} are Inductor settings; "
                         f"backend={backend!r} takes neither")
    else:
        settings = {"mode": mode, "options": dict(options) if options else None}
    if not model_guards:
        settings["options"] = {**(settings["options"] or {}), "guard_filter_fn": _unguarded_stack}
    compiled = torch.compile(_own_code(_run_step), backend=backend, dynamic=dynamic, fullgraph=fullgraph,
                             **settings, **kwargs)
    return CompiledStep(stack, compiled, checks, step_graphs and stack.cache.device.type == "cuda")


class CompiledStep:
    """What :func:`compile_step` returns: ``step_fn(x [T, hidden] bf16, step) -> [T, hidden] bf16``.

    Before entering the compiled graph, on the host and from Python values only: refuses a step
    under autograd and ``DRAFT_EXTEND`` on a stack with compressed layers (what eager validation
    would say), returns a step with no rows at once (it computes and writes nothing), and hands
    Dynamo the step in one canonical form (:func:`_graph_step`). ``graphs`` (whole-step CUDA
    graphs, :class:`~dsv4_compile.step_graphs.StepGraphs`) is set when compiled with
    ``cuda_graphs="step"`` on a CUDA stack. Outputs of a CUDA-graph replay are overwritten by the
    next replay: clone what you keep.
    """

    def __init__(self, stack: DSV4AttentionStack | ModelBackend, compiled: Callable, device_checks: bool,
                 step_graphs: bool = False):
        self.stack, self.compiled, self.device_checks = stack, compiled, device_checks
        self._compresses = any(stack.config.compress_ratios)
        # walking a model's modules for its parameters costs ~1 ms of host time per call in grad
        # mode; a parameter replaced later changes the frame's guards, and its retrace checks again
        self._parameters = tuple(stack.parameters())
        self.graphs = StepGraphs(self._run_compiled, stack.cache.device) if step_graphs else None

    def __call__(self, x: torch.Tensor, step: StepInputs, *extra: torch.Tensor) -> torch.Tensor:
        require_inference(self.stack, x, self._parameters)
        if step.mode is ForwardMode.DRAFT_EXTEND and self._compresses:
            raise ValueError("step.mode: DRAFT_EXTEND is for SWA-only (draft) stacks; this stack has "
                             "compressed layers")
        if step.num_tokens == 0:
            return self.stack.empty_output(x, *extra)
        if self.graphs is not None:
            return self.graphs(x, step, extra)
        return self._run_compiled(x, step, extra)

    def _run_compiled(self, x: torch.Tensor, step: StepInputs, extra: tuple[torch.Tensor, ...]) -> torch.Tensor:
        """The compiled function, handed its inputs as contiguous non-views and ``step`` in
        :func:`_graph_step`'s form."""
        _install_frame_callbacks()
        _STEP_CALLS.depth += 1
        try:
            return self.compiled(self.stack, _plain(x), _graph_step(step), tuple(_plain(t) for t in extra),
                                 self.device_checks)
        finally:
            _STEP_CALLS.depth -= 1


class _StepCalls(threading.local):
    """Compiled-step calls in progress on this thread (``depth``) and, while Dynamo compiles a frame
    inside one, the :data:`FRAME_SHAPE_CONFIG` / :data:`FRAME_DYNAMO_CONFIG` patches it entered.
    They are entered from Dynamo's compile callbacks rather than around every call: a replay costs
    a counter update, not a config change (~10 µs), and frames other code compiles keep the
    process's settings."""
    depth = 0
    patches: list | None = None


_STEP_CALLS = _StepCalls()


def _install_frame_callbacks() -> None:
    """Register the two callbacks below with Dynamo, unless they are: ``torch._dynamo.reset()``
    drops every compile callback, so a call checks, not the import."""
    handler = torch._dynamo.callback.callback_handler
    if _enter_frame_config not in handler.start_callbacks:
        handler.register_start_callback(_enter_frame_config)
        handler.register_end_callback(_exit_frame_config)


def _enter_frame_config(args) -> None:
    if _STEP_CALLS.depth and _STEP_CALLS.patches is None and args.callback_trigger is CallbackTrigger.DYNAMO:
        _STEP_CALLS.patches = [torch.fx.experimental._config.patch(**FRAME_SHAPE_CONFIG),
                               torch._dynamo.config.patch(**FRAME_DYNAMO_CONFIG)]
        for patch in _STEP_CALLS.patches:
            patch.__enter__()


def _exit_frame_config(args) -> None:
    if _STEP_CALLS.patches is not None:
        patches, _STEP_CALLS.patches = _STEP_CALLS.patches, None
        for patch in reversed(patches):
            patch.__exit__(None, None, None)


def _unguarded_stack(entries) -> list[bool]:
    """``guard_filter_fn`` of ``model_guards=False``: keep every guard but those whose source
    starts at the compiled function's ``stack`` argument."""
    return [_root_local(entry.orig_guard.originating_source) != "stack" for entry in entries]


def _root_local(source) -> str | None:
    """The name of the local variable ``source`` (a Dynamo guard source) is reached from, if any."""
    while source is not None and not isinstance(source, LocalSource):
        source = getattr(source, "base", None)
    return None if source is None else source.local_name


def _graph_step(step: StepInputs) -> StepInputs:
    """``step`` as the compiled function receives it: mode :data:`GRAPH_MODE`, no views, and with
    no request its three empty request tensors as one, the way ``StepInputs.idle`` builds it
    (Dynamo guards on views and on aliasing, each a frame of its own otherwise)."""
    rows, seq_lens, extend_lens, loc = (_plain(t) for t in step.tensors())
    if not rows.shape[0]:
        seq_lens = extend_lens = rows
    return StepInputs(GRAPH_MODE, rows, seq_lens, extend_lens, loc)


def _plain(t: torch.Tensor) -> torch.Tensor:
    """``t`` as a contiguous tensor that is not a view: a view's memory re-wrapped, a strided
    tensor (a decode loop's ``tokens[:, -1]``) copied. Dynamo guards on both, so either would
    compile a frame of its own."""
    if not t.is_contiguous():
        return t.contiguous()
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
