"""Whole-step CUDA graphs: a compiled step captured as one ``torch.cuda.CUDAGraph`` per input
signature and replayed without entering Dynamo (``compile_step(..., cuda_graphs="step")``).

Why: under CUDA-graph trees (``mode="reduce-overhead"``) a call replays one graph, but around
that replay the host runs Dynamo's guards, AOTAutograd's runtime wrappers and the trees'
bookkeeping (generation and liveness checks, one copy per input, output reconstruction): on the
H200's host 160–350 µs a call for the 3-layer Flash stack (benchmarks/README.md, "Whole-step CUDA
graphs"). A step whose result the caller waits for (a decode loop that reads its tokens) pays that
time on top of the GPU's. Here a call is a dictionary look-up, one ``torch._foreach_copy_`` into
the graph's static inputs and ``graph.replay()``: 20–35 µs. A caller that writes its inputs into
the static tensors themselves (:meth:`StepGraphs.static_inputs`), as a hand-written CUDA-graph loop
does, is not copied at all: the call is the look-up and the replay.

How: a call is keyed by its signature, the shapes and dtypes of ``x``, the step's four tensors and
the extra inputs, and whether inference mode is on. The first call of a signature copies its inputs
into static tensors of its own and runs the compiled step on them (on a side stream, outside any
capture: Dynamo may compile a frame, Triton a kernel); the second copies its inputs in, captures
the same call into a graph that shares one memory pool with the step's other graphs, and replays
it; every later call copies and replays. Each call runs the step exactly once, so the cache sees
every write once.

Contract (what a replay does not look at): the stack stays as it was compiled, as with
``compile_step(model_guards=False)``: weights and cache contents updated in place are seen; a
module, parameter or buffer replaced by another tensor is not (its old memory stays captured).
Outputs are the graph's static tensors: the next call of the same step (any signature: the graphs
share their pool) overwrites them, so clone what you keep.
"""

from __future__ import annotations

import operator
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from .step import StepInputs

# run(x, step, extra) -> outputs: the compiled step on tensors that are not views
Run = Callable[[torch.Tensor, StepInputs, tuple[torch.Tensor, ...]], Any]


# The foreach copy's kernel gives one thread block to each chunk of _FOREACH_CHUNK elements of a
# tensor, a thread copying one element at a time. As bytes an 8-row step's 64 KB of hidden state was
# one block's 65,536 elements, 13.7 µs of an H100's time; as 8-byte words 9.7 µs less. Past one chunk
# of bytes a wider word puts more bytes on each block (at 64 rows, 512 KB on one block as words:
# 18.4 µs, against 14.2 as bytes on eight), so larger inputs stay bytes.
_FOREACH_CHUNK = 65536
_WORDS = (torch.int64, torch.int32, torch.int16, torch.uint8)  # widest first


def _viewed_as(tensors: list[torch.Tensor], word: torch.dtype) -> list[torch.Tensor] | None:
    """``tensors`` reinterpreted as ``word`` elements, or None where one cannot be (its last
    dimension strided, or its bytes or offset not a multiple of the word)."""
    try:
        return [t.view(word) for t in tensors]
    except RuntimeError:
        return None


@dataclass
class _Signature:
    """The static inputs of one signature and, once captured, its graph and output tensors."""

    x: torch.Tensor
    step: StepInputs
    extra: tuple[torch.Tensor, ...]
    graph: torch.cuda.CUDAGraph | None = None
    outputs: Any = None
    inputs: list[torch.Tensor] = field(init=False)  # every static tensor a call copies into
    bytes: list[torch.Tensor] | None = field(init=False)  # :attr:`inputs` as uint8
    words: list[torch.Tensor] | None = field(init=False)  # :attr:`inputs` as the word a call copies (_FOREACH_CHUNK)

    def __post_init__(self):
        self.inputs = _flat_inputs(self.x, self.step, self.extra)
        self.bytes = _viewed_as(self.inputs, torch.uint8)
        self.words = self.bytes
        if max(t.nbytes for t in self.inputs) <= _FOREACH_CHUNK:  # one block each: the widest word all fit
            self.words = next((v for word in _WORDS if (v := _viewed_as(self.inputs, word)) is not None), None)

    def holds(self, inputs: list[torch.Tensor]) -> bool:
        """Whether ``inputs`` are this signature's static tensors themselves (nothing to copy)."""
        return all(map(operator.is_, inputs, self.inputs))


def _flat_inputs(x: torch.Tensor, step: StepInputs, extra: tuple[torch.Tensor, ...]) -> list[torch.Tensor]:
    return [x, *step.tensors(), *extra]


def _key(inputs: list[torch.Tensor]) -> tuple:
    """A call's signature: the inputs' shapes and dtypes, and inference mode (static copies made
    under it are inference tensors, which take in-place copies only under inference mode, and
    Dynamo compiles a frame of their own for its calls)."""
    return (torch.is_inference_mode_enabled(), *((t.shape, t.dtype) for t in inputs))


def _copy_in(sig: _Signature, inputs: list[torch.Tensor]) -> None:
    """Copy a call's inputs into ``sig``'s static tensors in one launch: reinterpreted as one
    integer dtype (:attr:`_Signature.words`, else bytes), every pair has one dtype, which
    ``torch._foreach_copy_`` needs to copy them all in one kernel (a launch costs ~6 µs of host time
    on the H200's host, the replay ~3). Inputs that cannot be viewed so (a strided last dimension)
    are copied dtype by dtype."""
    for statics in (sig.words, sig.bytes):
        if statics is not None and (sources := _viewed_as(inputs, statics[0].dtype)) is not None:
            torch._foreach_copy_(statics, sources)
            return
    torch._foreach_copy_(sig.inputs, inputs)


def _static_copy(x: torch.Tensor, step: StepInputs, extra: tuple[torch.Tensor, ...]) -> _Signature:
    """Contiguous copies of the inputs; without requests the step's three request tensors are one
    tensor, as ``StepInputs.idle`` builds them (the form the compiled frames take)."""
    rows, seq_lens, extend_lens, loc = (t.clone(memory_format=torch.contiguous_format) for t in step.tensors())
    if not rows.shape[0]:
        seq_lens = extend_lens = rows
    return _Signature(x.clone(memory_format=torch.contiguous_format),
                      StepInputs(step.mode, rows, seq_lens, extend_lens, loc),
                      tuple(t.clone(memory_format=torch.contiguous_format) for t in extra))


class StepGraphs:
    """The whole-step CUDA graphs of one compiled step (module docstring): ``graphs(x, step,
    extra)`` runs ``run`` once per call, through a replayed graph from a signature's second call.

    Args:
        run: the compiled step, ``run(x, step, extra) -> outputs`` (a tensor or a tuple of them).
        device: the CUDA device the step runs on.
    """

    def __init__(self, run: Run, device: torch.device):
        self.run, self.device = run, device
        self.signatures: dict[tuple, _Signature] = {}
        self.stream = torch.cuda.Stream(device)  # warm-ups and captures run here, off the caller's stream
        self.pool = None  # the memory pool every graph of this step allocates from

    def __call__(self, x: torch.Tensor, step: StepInputs, extra: tuple[torch.Tensor, ...]) -> Any:
        inputs = _flat_inputs(x, step, extra)
        key = _key(inputs)
        sig = self.signatures.get(key)
        if sig is None:  # a signature is kept once its step has run: its frame is compiled then
            sig = _static_copy(x, step, extra)
            outputs = self._on_side_stream(lambda: self.run(sig.x, sig.step, sig.extra))
            self.signatures[key] = sig
            return outputs
        if not sig.holds(inputs):
            _copy_in(sig, inputs)
        if sig.graph is None:
            try:
                self._capture(sig)
            except BaseException:  # nothing half-captured stays: the next call warms up again
                del self.signatures[key]
                raise
        sig.graph.replay()
        return sig.outputs

    def static_inputs(self, x: torch.Tensor, step: StepInputs, extra: tuple[torch.Tensor, ...] = ()
                      ) -> tuple[torch.Tensor, StepInputs, tuple[torch.Tensor, ...]] | None:
        """The static ``(x, step, extra)`` of these inputs' signature once it has run (else None).
        Write the next call's values into them in place (``copy_``, or an ``out=`` of the kernel
        that makes them, on the caller's stream) and call with them: the call copies nothing.
        Their shapes and dtypes are the signature's: do not resize them."""
        sig = self._signature_of(x, step, extra)
        return (sig.x, sig.step, sig.extra) if sig is not None else None

    def captured(self, x: torch.Tensor, step: StepInputs, extra: tuple[torch.Tensor, ...] = ()
                 ) -> torch.cuda.CUDAGraph | None:
        """The graph calls with these inputs' signature replay, once captured (else None)."""
        sig = self._signature_of(x, step, extra)
        return sig.graph if sig is not None else None

    def _signature_of(self, x: torch.Tensor, step: StepInputs, extra: tuple[torch.Tensor, ...]) -> _Signature | None:
        return self.signatures.get(_key(_flat_inputs(x, step, extra)))

    @property
    def num_graphs(self) -> int:
        """Graphs captured so far (one per signature seen at least twice)."""
        return sum(sig.graph is not None for sig in self.signatures.values())

    def _on_side_stream(self, fn: Callable[[], Any]) -> Any:
        """``fn()`` on :attr:`stream`, ordered after the caller's queued work and before its next."""
        caller = torch.cuda.current_stream(self.device)
        self.stream.wait_stream(caller)
        with torch.cuda.stream(self.stream):
            out = fn()
        caller.wait_stream(self.stream)
        return out

    def _capture(self, sig: _Signature) -> None:
        graph = torch.cuda.CUDAGraph()
        # torch.cuda.graph synchronises the device first, so the inputs just copied are in place
        with torch.cuda.graph(graph, pool=self.pool, stream=self.stream):
            outputs = self.run(sig.x, sig.step, sig.extra)
        self.pool = self.pool or graph.pool()
        sig.graph, sig.outputs = graph, outputs
