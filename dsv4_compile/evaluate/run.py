"""Running a task on the backend: the runner and its step (compiled or eager), warm-up, and the
perplexity and generation loops, timed apart from compilation, with a progress bar.

Compilation happens in :meth:`ModelRunner.warmup <dsv4_compile.runner.ModelRunner.warmup>`; Dynamo
frames compiled after it are counted (a compiled runner compiles none: docs/model.md, "Zero
recompiles"). Time spent in Dynamo's compile callbacks during the loops — CUDA-graph recordings of
new bucket combinations on a GPU — is reported with compilation, not with tokens/s.
"""

from __future__ import annotations

import math
import sys
import time
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch._dynamo.utils import counters
from torch.distributed.device_mesh import DeviceMesh
from tqdm import tqdm

from ..compile import STEP_GRAPHS, CompiledStep, compile_step
from ..model import ModelBackend, enable
from ..runner import ModelRunner
from ..testing.bench import wall_call

# How a compiled step is compiled. On a GPU: Inductor, the whole step captured as CUDA graphs
# (cuda_graphs="step": a runner owns its model, which stays as compiled, and its loop reads every
# step back, where a call's host time adds to the GPU's: 20-35 µs a call against 160-350 µs with
# CUDA-graph trees on the H200's host). On a CPU: Dynamo's graph on the eager backend. The CPU
# kernels are the reference ops, which Inductor calls as they are: for the built-in model its cold
# compile of the warm-up frames took 545 s on 2 shared cores, and the steps ran no faster than
# eager ones.
COMPILED = {"cuda": ("inductor", "Inductor + whole-step CUDA graphs"),
            "cpu": ("eager", "Dynamo graph, eager backend (Inductor gains nothing on CPU reference kernels)")}
# Under tensor parallelism the collectives of a step are captured by CUDA-graph trees, whose
# capture of them is tested on several GPUs; whole-step graphs of collectives are not yet.
PARALLEL_CUDA = ("inductor", "Inductor + CUDA-graph trees")
# Sequences handed to the runner per call: the progress bar moves between calls, and the runner
# still batches continuously inside each.
CALL_SEQUENCES_PER_REQUEST = 4


@dataclass
class Timing:
    warmup_s: float  # warm-up, compilation included
    compile_s: float  # in Dynamo's compile callbacks, warm-up and loop together
    loop_s: float  # the loop, compilation excluded
    frames_after_warmup: int  # Dynamo's frame count when warm-up ended


def make_runner(model: torch.nn.Module, *, batch: int, max_seq_len: int, compiled: bool,
                device_mesh: DeviceMesh | None = None) -> tuple[ModelRunner, str]:
    """The backend on ``model`` with ``batch`` request rows of ``max_seq_len`` positions
    (tensor-parallel over ``device_mesh`` when given), and a runner on its step (see
    :func:`runner_on`); returns it and how it runs."""
    backend = enable(model, max_requests=batch, max_seq_len=max_seq_len, device_mesh=device_mesh)
    return runner_on(backend, compiled=compiled)


def runner_on(backend: ModelBackend, *, compiled: bool, **runner_kwargs) -> tuple[ModelRunner, str]:
    """A runner on ``backend``'s step (``runner_kwargs`` to :class:`ModelRunner`), compiled by
    :func:`compiled_step` or eager; returns it and how it runs."""
    parallel = "" if backend.device_mesh is None else f"; tensor-parallel over {backend.device_mesh.size()} ranks"
    if not compiled:
        return ModelRunner(backend, **runner_kwargs), "eager (not compiled)" + parallel
    step_fn, how = compiled_step(backend)
    return ModelRunner(backend, step_fn=step_fn, **runner_kwargs), how + parallel


def compiled_step(backend: ModelBackend) -> tuple[CompiledStep, str]:
    """``backend``'s step compiled as a runner runs it (:data:`COMPILED`, :data:`PARALLEL_CUDA`),
    and how."""
    cuda, sharded = backend.cache.device.type == "cuda", backend.device_mesh is not None
    backend_name, how = PARALLEL_CUDA if cuda and sharded else COMPILED[backend.cache.device.type]
    graphs = None if sharded else STEP_GRAPHS
    return compile_step(backend, backend=backend_name, cuda_graphs=graphs), how


class _CompileClock:
    """Seconds spent between Dynamo's compile start and end callbacks (graph compilations and
    CUDA-graph recordings) while entered."""

    def __init__(self):
        self.seconds, self._start = 0.0, 0.0

    def _on_start(self, *args) -> None:
        self._start = time.perf_counter()

    def _on_end(self, *args) -> None:
        self.seconds += time.perf_counter() - self._start

    def __enter__(self) -> "_CompileClock":
        torch._dynamo.callback_handler.register_start_callback(self._on_start)
        torch._dynamo.callback_handler.register_end_callback(self._on_end)
        return self

    def __exit__(self, *exc) -> None:
        torch._dynamo.callback_handler.remove_start_callback(self._on_start)
        torch._dynamo.callback_handler.remove_end_callback(self._on_end)


def timed(runner: ModelRunner, loop: Callable[[], object]) -> tuple[object, Timing]:
    """Warm ``runner`` up, then run ``loop()``; its result and the :class:`Timing`. Says on stderr
    that warm-up compiles, so that a long cold compile is not taken for a hang."""
    if runner.step_fn is not runner.backend:
        print("warm-up: compiling the step ...", file=sys.stderr, flush=True)
    return timed_after(runner.warmup, loop, runner.backend.cache.device)


def timed_after(warmup: Callable[[], object], loop: Callable[[], object], device: torch.device
                ) -> tuple[object, Timing]:
    """Run ``warmup()``, then ``loop()``, whose work runs on ``device``; the loop's result and the
    :class:`Timing`."""
    with _CompileClock() as clock:
        _, warmup_s = wall_call(warmup, device)
        warm_compile_s, frames = clock.seconds, counters["frames"]["total"]
        result, loop_s = wall_call(loop, device)
        loop_s -= clock.seconds - warm_compile_s
    return result, Timing(warmup_s, clock.seconds, loop_s, frames)


def quiet_libraries() -> None:
    """Silence notices that say nothing about the evaluation: Dynamo tracing through
    ``transformers``' cached version checks, ``transformers``' advice."""
    warnings.filterwarnings("ignore", message="Dynamo detected a call to a `functools.lru_cache`")
    from transformers.utils import logging

    logging.set_verbosity_error()


def score_all(runner: ModelRunner, sequences: Sequence[list[int]]) -> list[torch.Tensor]:
    """Teacher-forced log-probs of every sequence (``runner.score``), fp32 ``[L - 1]`` each."""
    out: list[torch.Tensor] = []
    with _bar(sum(map(len, sequences)), "perplexity") as bar:
        for chunk in _chunks(runner, sequences):
            out += runner.score(chunk)
            bar.update(sum(map(len, chunk)))
    return out


def generate_all(runner: ModelRunner, prompts: Sequence[list[int]], max_new_tokens: int) -> list[list[int]]:
    """Greedy continuations of ``max_new_tokens`` tokens of every prompt (``runner.generate``)."""
    out: list[list[int]] = []
    with _bar(sum(map(len, prompts)) + max_new_tokens * len(prompts), "generate") as bar:
        for chunk in _chunks(runner, prompts):
            out += runner.generate(chunk, max_new_tokens)
            bar.update(sum(map(len, chunk)) + max_new_tokens * len(chunk))
    return out


def perplexity(log_probs: Sequence[torch.Tensor]) -> float:
    """``exp`` of the mean negative log-prob over every scored token (nan when there is none)."""
    count = sum(t.numel() for t in log_probs)
    total = sum(float(t.double().sum()) for t in log_probs)
    return math.exp(-total / count) if count else math.nan


def _chunks(runner: ModelRunner, sequences: Sequence[list[int]]):
    size = CALL_SEQUENCES_PER_REQUEST * runner.allocator.cache.max_requests
    return (sequences[i:i + size] for i in range(0, len(sequences), size))


def _bar(tokens: int, what: str) -> tqdm:
    """A progress bar over ``tokens`` tokens on stderr (shown on a terminal only)."""
    return tqdm(total=tokens, desc=what, unit="tok", file=sys.stderr, disable=None,
                leave=False, dynamic_ncols=True)
