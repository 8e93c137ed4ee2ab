"""Ahead-of-time deployment: ``torch.export`` of a model's steps and AOTInductor packages of them.

:func:`export_steps` exports the step of a model on the backend (:class:`~dsv4_compile.model.ModelBackend`)
as programs of flat tensors, one per entry of :data:`PROGRAMS`::

    logits [R, vocab] = program(input_ids [T] int64, req_rows [B] int32, seq_lens [B] int32,
                                extend_lens [B] int32, out_cache_loc [T] int64, logit_rows [R] int64,
                                *cache)

``cache`` is every buffer of the backend's :class:`~dsv4_compile.cache.DSV4Cache`, in
``named_buffers()`` order (:func:`cache_spec`): the index maps the host allocator writes between
steps and the pools the step writes. They are inputs, mutated in place by the program, never
constants: the programs hold the model's weights and nothing of the cache, so a package does not
grow with the cache and always sees the allocator's latest maps. T, B and R are symbolic within
the capacity the programs are exported for; the cache shapes are fixed.

With ``inline_ops=True`` (the default) each ``dsv4::`` op is traced as its reference code
(``ops._library.traced_references``), so the programs hold aten ops only and Inductor compiles all
of them into the package: it runs with libtorch alone (no Python, no ``dsv4_compile``), from
Python or C++. With ``inline_ops=False`` the ops stay ``dsv4::`` custom ops, which a package calls
back into Python for (``import dsv4_compile`` first), running their CUDA kernels on a GPU.

:func:`package` compiles the programs with AOTInductor into one ``.pt2`` holding one named model
per program and the metadata :mod:`dsv4_compile.deploy` (and ``deploy/cpp``) check on load.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
from collections.abc import Sequence

import torch
from torch import nn
from torch._inductor.package import package_aoti
from torch.export import Dim, ExportedProgram

from .cache import DSV4Cache
from . import hf_experts
from .model import ModelBackend
from .ops._library import traced_references
from .step import REQUEST_BUCKETS, TOKEN_BUCKETS, ForwardMode, StepInputs, bucket

# extend: any step (prefill, chunked prefill beside decodes, target verify): T and B independent;
# decode: one token per request, T = B (the program knows the two are equal).
PROGRAMS = ("extend", "decode")
# Inductor rounds to bf16 wherever eager does (without it, fused fp32 intermediates move the logits
# of the 3-layer test model by up to 7e-2 of their largest magnitude; with it, what is left is the
# order of fused reductions: docs/deploy.md, "Numerics").
EXACT_NUMERICS = {"emulate_precision_casts": True}
STEP_INPUTS = ("input_ids", "req_rows", "seq_lens", "extend_lens", "out_cache_loc", "logit_rows")
# Sizes of the tracing examples: above 1, which torch.export would specialise on.
_EXAMPLE_REQUESTS, _EXAMPLE_TOKENS = 2, 3
# A package calls the ATen ops Inductor does not generate code for through AOTInductor's C shim.
# torch 2.11's CUDA shim has no ``_grouped_mm`` (2.13's has), so a GPU package of the grouped
# experts fails to compile there; it is exported with this implementation instead.
SHIMLESS_EXPERTS_FALLBACK = "batched_mm"
FORMAT_VERSION = "1"
METADATA_KEY = "dsv4_compile"


@dataclasses.dataclass(frozen=True)
class ExportLimits:
    """Largest symbolic sizes of the exported programs: ``max_tokens`` query rows and
    ``max_batch`` requests a step (padding requests included); logit rows up to
    :attr:`max_logit_rows`."""

    max_tokens: int
    max_batch: int

    @property
    def max_logit_rows(self) -> int:
        """``max_tokens``, and at least 2: a runner pads its logit rows to 2 (``ModelRunner.run_step``),
        which the programs take whatever the limits (their example size)."""
        return max(self.max_tokens, _EXAMPLE_REQUESTS)

    def __post_init__(self):
        for name in ("max_tokens", "max_batch"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"ExportLimits.{name}={value!r} must be an int >= 1")


def default_limits(backend: ModelBackend) -> ExportLimits:
    """The sizes ``backend.runner`` pads its steps to: its token bucket and the request bucket of
    the cache's request rows."""
    return ExportLimits(bucket(backend.runner.max_step_tokens, TOKEN_BUCKETS),
                        bucket(backend.cache.max_requests, REQUEST_BUCKETS))


def cache_spec(cache: DSV4Cache) -> list[tuple[str, tuple[int, ...], str]]:
    """``(name, shape, dtype)`` of each buffer of ``cache``, in the order the programs take them."""
    return [(name, tuple(t.shape), str(t.dtype).removeprefix("torch.")) for name, t in cache.named_buffers()]


class StepProgram(nn.Module):
    """``backend``'s step as a function of flat tensors (module docstring). The model's
    parameters and buffers are this module's own (they become the program's constants); the
    cache is not registered, so it is not: ``forward`` swaps the given tensors in for the cache's
    buffers (``torch.func.functional_call``)."""

    def __init__(self, backend: ModelBackend):
        super().__init__()
        object.__setattr__(self, "backend", backend)  # not a submodule: its cache must not be state
        self.model, self.attn_layers = backend.model, backend.attn_layers
        self._cache_names = [f"cache.{name}" for name, _ in backend.cache.named_buffers()]

    def forward(self, input_ids: torch.Tensor, req_rows: torch.Tensor, seq_lens: torch.Tensor,
                extend_lens: torch.Tensor, out_cache_loc: torch.Tensor, logit_rows: torch.Tensor,
                *cache: torch.Tensor) -> torch.Tensor:
        step = StepInputs(ForwardMode.EXTEND, req_rows, seq_lens, extend_lens, out_cache_loc)
        return torch.func.functional_call(self.backend, dict(zip(self._cache_names, cache)),
                                          (input_ids, step, logit_rows), {"validate": False},
                                          strict=False, tie_weights=False)


def example_inputs(backend: ModelBackend, program: str) -> tuple[torch.Tensor, ...]:
    """Inputs that trace ``program``: two requests on the dummy row (nothing real is written:
    slot 0, page 0) and the live cache buffers."""
    if program not in PROGRAMS:
        raise ValueError(f"program={program!r}: expected one of {PROGRAMS}")
    device = backend.cache.device
    tokens = _EXAMPLE_REQUESTS if program == "decode" else _EXAMPLE_TOKENS
    i32 = dict(dtype=torch.int32, device=device)
    step = (torch.zeros(tokens, dtype=torch.int64, device=device), torch.zeros(_EXAMPLE_REQUESTS, **i32),
            torch.zeros(_EXAMPLE_REQUESTS, **i32), torch.zeros(_EXAMPLE_REQUESTS, **i32),
            torch.zeros(tokens, dtype=torch.int64, device=device),
            torch.zeros(_EXAMPLE_REQUESTS, dtype=torch.int64, device=device))
    return (*step, *backend.cache.buffers())


def dynamic_shapes(program: str, limits: ExportLimits, num_cache: int) -> tuple:
    """``torch.export`` dynamic shapes of ``program``'s inputs: T, B, R symbolic from 1 (decode: T is B)
    up to the limits, or up to the example sizes where those are larger (a limit of 1 cannot bound a
    symbolic size, and the examples must be above 1 to stay symbolic); ``deploy`` enforces the limits."""
    batch = Dim("requests", min=1, max=max(limits.max_batch, _EXAMPLE_REQUESTS))
    tokens = batch if program == "decode" else Dim("tokens", min=1, max=max(limits.max_tokens, _EXAMPLE_TOKENS))
    rows = Dim("logit_rows", min=1, max=limits.max_logit_rows)
    return ({0: tokens}, {0: batch}, {0: batch}, {0: batch}, {0: tokens}, {0: rows}, (None,) * num_cache)


def export_steps(backend: ModelBackend, programs: Sequence[str] = PROGRAMS, *, limits: ExportLimits | None = None,
                 inline_ops: bool = True) -> dict[str, ExportedProgram]:
    """``torch.export`` each of ``programs`` (names in :data:`PROGRAMS`) of ``backend``'s step
    (module docstring); ``limits`` default to :func:`default_limits`. The programs are decomposed
    to the ATen inference IR (what AOTInductor compiles). Nothing is written to the cache."""
    limits = limits or default_limits(backend)
    module = StepProgram(backend)
    exported = {}
    for name in programs:
        args = example_inputs(backend, name)
        ops_mode = traced_references() if inline_ops else contextlib.nullcontext()
        with torch.no_grad(), ops_mode:  # non-strict export traces on fake tensors: nothing is written
            ep = torch.export.export(module, args, dynamic_shapes=dynamic_shapes(name, limits, len(args) - len(STEP_INPUTS)),
                                     strict=False)
        exported[name] = ep.run_decompositions()
    return exported


def package_metadata(backend: ModelBackend, programs: Sequence[str], limits: ExportLimits,
                     inline_ops: bool) -> dict[str, str]:
    """What a package states about itself (AOTInductor metadata: string to string), read by
    :func:`dsv4_compile.deploy.load` and ``deploy/cpp``: the attention config, the cache's
    capacity and buffer shapes, the step signature, the programs, the vocabulary."""
    cache = backend.cache
    config = dataclasses.asdict(backend.config)
    info = {"format": FORMAT_VERSION, "config": config, "max_requests": cache.max_requests,
            "max_seq_len": cache.max_seq_len, "num_full_pages": cache.num_full_pages,
            "num_swa_pages": cache.num_swa_pages, "vocab_size": backend.vocab_size,
            "programs": list(programs), "inputs": list(STEP_INPUTS), "cache": cache_spec(cache),
            "limits": dataclasses.asdict(limits), "inline_ops": inline_ops}
    flat = {f"{METADATA_KEY}.{k}": str(v) for k, v in
            (("max_requests", cache.max_requests), ("max_seq_len", cache.max_seq_len),
             ("vocab_size", backend.vocab_size), ("num_cache_buffers", len(info["cache"])),
             ("max_tokens", limits.max_tokens), ("max_batch", limits.max_batch))}
    # one entry per cache buffer, for readers without a JSON parser (deploy/cpp): "dtype:d0,d1"
    for i, (name, shape, dtype) in enumerate(info["cache"]):
        flat[f"{METADATA_KEY}.cache.{i}"] = f"{name}:{dtype}:{','.join(map(str, shape))}"
    return {METADATA_KEY: json.dumps(info), **flat}


def package(backend: ModelBackend, path: str | os.PathLike, programs: Sequence[str] = PROGRAMS, *,
            limits: ExportLimits | None = None, inline_ops: bool = True,
            inductor_configs: dict | None = None) -> str:
    """Export ``programs`` of ``backend`` (:func:`export_steps`) and compile them with
    AOTInductor into the package ``path`` (``.pt2``), one named model per program plus the
    :func:`package_metadata`. ``inductor_configs`` update :data:`EXACT_NUMERICS`. Returns the path."""
    limits = limits or default_limits(backend)
    with _packageable_experts(backend.model, backend.cache.device):
        exported = export_steps(backend, programs, limits=limits, inline_ops=inline_ops)
    configs = {**EXACT_NUMERICS, **(inductor_configs or {}), "aot_inductor.package": True,
               "aot_inductor.metadata": package_metadata(backend, programs, limits, inline_ops)}
    files = {}
    for name, ep in exported.items():
        args, kwargs = ep.example_inputs
        files[name] = torch._inductor.aot_compile(ep.module(check_guards=False), args, kwargs, options=configs)
    return package_aoti(os.fspath(path), files)


def has_c_shim(op: str, device: torch.device) -> bool:
    """Whether this torch's AOTInductor C shim for ``device`` declares ``op`` (an ATen op name such as
    ``"_grouped_mm"``), read from the header a package's generated code is compiled against."""
    header = os.path.join(os.path.dirname(torch.__file__), "include", "torch", "csrc", "inductor", "aoti_torch",
                          "generated", f"c_shim_{device.type}.h")
    with open(header) as f:
        return f"aoti_torch_{device.type}_{op}(" in f.read()


@contextlib.contextmanager
def _packageable_experts(model: nn.Module, device: torch.device):
    """While entered, ``model``'s MoE experts run an implementation this torch can package on
    ``device``: ``grouped_mm`` in place of the backend's own (its CUDA kernels are Python
    launchers, which a package cannot hold), :data:`SHIMLESS_EXPERTS_FALLBACK` in place of
    ``grouped_mm`` where the C shim lacks it; the model's own implementation is set back on exit."""
    own = model.config._experts_implementation
    packaged = "grouped_mm" if own == hf_experts.IMPLEMENTATION else own
    if packaged == "grouped_mm" and device.type == "cuda" and not has_c_shim("_grouped_mm", device):
        packaged = SHIMLESS_EXPERTS_FALLBACK
    if packaged == own:
        yield
        return
    model.set_experts_implementation(packaged)
    try:
        yield
    finally:
        model.set_experts_implementation(own)
