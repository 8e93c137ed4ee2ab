"""Running a package made by :func:`dsv4_compile.export.package`: ``load(path)`` -> :class:`DeployedModel`.

A :class:`DeployedModel` holds the package's compiled steps, a :class:`~dsv4_compile.cache.DSV4Cache`
of the capacity the package was built for (from its metadata) and the cache's host-side
:class:`~dsv4_compile.allocator.PageAllocator`. Calling it runs one step with the model step's
signature, ``model(input_ids, step, logit_rows) -> logits``, so the
:class:`~dsv4_compile.runner.ModelRunner` (``model.runner``: ``score``, ``generate``) serves a
package as it serves a model on the backend. The model's Python code and weights are not needed:
the package holds the weights and, when built with ``inline_ops=True``, every op.
"""

from __future__ import annotations

import json
import os
import zipfile
from dataclasses import dataclass

import torch
from torch._inductor.package import load_package

from .allocator import PageAllocator
from .cache import DSV4Cache
from .config import DSV4AttnConfig
from .export import FORMAT_VERSION, METADATA_KEY, ExportLimits, cache_spec
from .model import check_model_inputs
from .runner import ModelRunner
from .step import ForwardMode, StepInputs
from .validate import validate_step


class PackageError(ValueError):
    """A package that is not a dsv4_compile package, or that does not fit what its user asked for."""


# What AOTInductor records in a package's metadata: the device type its code was compiled for.
AOTI_DEVICE_KEY = "AOTI_DEVICE_KEY"


@dataclass(frozen=True)
class PackageInfo:
    """What a package states about itself (``export.package_metadata``)."""

    config: DSV4AttnConfig
    max_requests: int
    max_seq_len: int
    num_full_pages: int
    num_swa_pages: int
    vocab_size: int
    programs: tuple[str, ...]
    cache: tuple[tuple[str, tuple[int, ...], str], ...]
    limits: ExportLimits
    inline_ops: bool

    @classmethod
    def from_metadata(cls, path: str, metadata: dict[str, str]) -> "PackageInfo":
        if METADATA_KEY not in metadata:
            raise PackageError(f"{path}: not a dsv4_compile package (no {METADATA_KEY!r} metadata)")
        info = json.loads(metadata[METADATA_KEY])
        if info.get("format") != FORMAT_VERSION:
            raise PackageError(f"{path}: package format {info.get('format')!r}, this dsv4_compile reads "
                               f"{FORMAT_VERSION!r}: rebuild it with dsv4_compile.export.package")
        config = dict(info["config"], compress_ratios=tuple(info["config"]["compress_ratios"]))
        return cls(DSV4AttnConfig(**config), info["max_requests"], info["max_seq_len"], info["num_full_pages"],
                   info["num_swa_pages"], info["vocab_size"], tuple(info["programs"]),
                   tuple((n, tuple(s), d) for n, s, d in info["cache"]), ExportLimits(**info["limits"]),
                   info["inline_ops"])


class DeployedModel:
    """A package's steps over a cache of its own (module docstring).

    ``model(input_ids [T] int64, step, logit_rows [R] int64) -> logits [R, vocab]``: the
    ``decode`` program for a ``DECODE`` step with one row per request when the package has it,
    else ``extend``; the step is checked on the host first (``validate``), as the backend's eager
    step checks it. ``T``, ``B`` and ``R`` must lie within the package's ``limits``.
    """

    def __init__(self, path: str, programs: dict[str, object], info: PackageInfo, device: torch.device):
        self.path, self.programs, self.info = path, programs, info
        self.config = info.config
        self.cache = DSV4Cache(info.config, max_requests=info.max_requests, max_seq_len=info.max_seq_len,
                               num_full_pages=info.num_full_pages, num_swa_pages=info.num_swa_pages, device=device)
        _check_cache(path, self.cache, info)
        self.allocator = PageAllocator(self.cache)
        self.device_mesh = None  # a package runs on one device
        # unbucketed: the programs take any size within the limits, and a bucket may lie beyond them
        self.runner = ModelRunner(self, max_step_tokens=info.limits.max_tokens, bucketed=False)

    @property
    def vocab_size(self) -> int:
        return self.info.vocab_size

    def new_logits(self, *shape: int) -> torch.Tensor:
        """Zeros ``[*shape]`` in the dtype of the logits (bf16), on the cache's device."""
        return torch.zeros(shape, dtype=torch.bfloat16, device=self.cache.device)

    def empty_output(self, input_ids: torch.Tensor, logit_rows: torch.Tensor) -> torch.Tensor:
        """The logits of a step with no rows (nothing is computed or written)."""
        return self.new_logits(logit_rows.shape[0], self.vocab_size)

    def __call__(self, input_ids: torch.Tensor, step: StepInputs, logit_rows: torch.Tensor,
                 validate: bool = True) -> torch.Tensor:
        if validate:
            check_model_inputs(self, input_ids, step, logit_rows)
            validate_step(self.config, self.cache, _rows_like(input_ids, self.config), step)
            self._check_limits(step, logit_rows)
        if step.num_tokens == 0:
            return self.empty_output(input_ids, logit_rows)
        name = "decode" if self._is_decode(step) else "extend"
        step, input_ids, logit_rows = _as_exported(step), _as_int64(input_ids), _as_int64(logit_rows)
        return self.programs[name](input_ids, *step.tensors(), logit_rows, *self.cache.buffers())

    def _is_decode(self, step: StepInputs) -> bool:
        return "decode" in self.programs and step.mode is ForwardMode.DECODE and step.num_tokens == step.batch_size

    def _check_limits(self, step: StepInputs, logit_rows: torch.Tensor) -> None:
        limits = self.info.limits
        for name, n, most in (("step.out_cache_loc", step.num_tokens, limits.max_tokens),
                              ("step.req_rows", step.batch_size, limits.max_batch),
                              ("logit_rows", logit_rows.shape[0], limits.max_logit_rows)):
            if n > most:
                raise ValueError(f"{name} has {n} rows; the package {self.path} was built for at most {most}")
        if "extend" not in self.programs and not self._is_decode(step):
            raise ValueError(f"step: the package {self.path} holds only {list(self.programs)}, not a program "
                             f"for a {step.mode.value} step of {step.num_tokens} rows and {step.batch_size} requests")


def _as_exported(step: StepInputs) -> StepInputs:
    """``step`` as the programs were exported for, which they take without checking: contiguous
    tensors in :class:`StepInputs`' dtypes (validation takes int32 and int64 alike) and at least one
    request (a step of none gets the padding request the step builder adds: row 0, no tokens)."""
    per_request = [t.to(torch.int32).contiguous() for t in step.tensors()[:3]]
    if step.batch_size == 0:
        per_request = [t.new_zeros(1) for t in per_request]
    return StepInputs(step.mode, *per_request, _as_int64(step.out_cache_loc))


def _as_int64(t: torch.Tensor) -> torch.Tensor:
    return t.to(torch.int64).contiguous()


def _rows_like(input_ids: torch.Tensor, config: DSV4AttnConfig) -> torch.Tensor:
    """A stand-in for the step's layer input (``validate_step`` reads only its shape and dtype)."""
    return torch.empty(input_ids.shape[0], config.hidden_size, dtype=torch.bfloat16,
                       device=input_ids.device)


def _check_cache(path: str, cache: DSV4Cache, info: PackageInfo) -> None:
    """The cache this library builds from the package's config must be the one it was built with."""
    if cache_spec(cache) != list(info.cache):
        raise PackageError(f"{path}: its cache layout differs from the one this dsv4_compile builds for its "
                           "config (a package of another version): rebuild it with dsv4_compile.export.package")


def load(path: str | os.PathLike, *, max_requests: int | None = None, max_seq_len: int | None = None,
         config: DSV4AttnConfig | None = None, device: str | torch.device | None = None) -> DeployedModel:
    """Load the package ``path``, its cache on ``device`` (default: the device type the package was
    compiled for, its first device; another type is a :class:`PackageError`). ``max_requests``,
    ``max_seq_len`` and ``config``, when given, must equal what the package was built for:
    :class:`PackageError` otherwise (a package cannot serve another capacity or model)."""
    path = os.fspath(path)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"path: no package at {path}")
    first = load_package(path, _first_model(path))
    metadata = first.get_metadata()
    info = PackageInfo.from_metadata(path, metadata)
    built_for = metadata.get(AOTI_DEVICE_KEY, "cpu")
    device = torch.device(built_for if device is None else device)
    for name, want, got in (("max_requests", max_requests, info.max_requests),
                            ("max_seq_len", max_seq_len, info.max_seq_len), ("config", config, info.config),
                            ("device", device.type, built_for)):
        if want is not None and want != got:
            raise PackageError(f"{name}={want!r}: the package {path} was built for {name}={got!r}")
    programs = {name: load_package(path, name) for name in info.programs}
    return DeployedModel(path, programs, info, device)


def _first_model(path: str) -> str:
    """The name of one model the package holds (every model carries the same metadata)."""
    if not zipfile.is_zipfile(path):
        raise PackageError(f"{path}: not an AOTInductor package (not a zip archive)")
    with zipfile.ZipFile(path) as archive:
        for name in archive.namelist():
            parts = name.split("/")
            if len(parts) > 4 and parts[1:3] == ["data", "aotinductor"]:
                return parts[3]
    raise PackageError(f"{path}: not an AOTInductor package")


@torch.no_grad()
def greedy_generate(model, prompts: list[list[int]], max_new_tokens: int, *, chunk: int) -> list[list[int]]:
    """Greedy continuations of ``prompts`` by the loop ``deploy/cpp`` runs, step for step: each
    prompt prefilled alone in chunks of at most ``chunk`` tokens, then one decode step per new
    token for every request together. ``model``: a :class:`DeployedModel` or a
    :class:`~dsv4_compile.model.ModelBackend` (its eager step), with free request rows for every
    prompt; the rows are released at the end, also when a step raises. Returns ``max_new_tokens`` ids per
    prompt (an empty prompt is a ``ValueError``)."""
    if max_new_tokens < 1 or chunk < 1:
        raise ValueError(f"max_new_tokens={max_new_tokens} and chunk={chunk} must be >= 1")
    if empty := [i for i, prompt in enumerate(prompts) if not len(prompt)]:
        raise ValueError(f"prompts: prompt {empty[0]} is empty (a continuation needs at least one token)")
    alloc, device = model.allocator, model.cache.device

    def ids(values: list[int]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.int64, device=device)

    rows, tokens = [], []
    try:
        for prompt in prompts:
            rows.append(alloc.admit())
            for start in range(0, len(prompt), chunk):
                part = prompt[start:start + chunk]
                loc = alloc.extend(rows[-1], len(part))
                step = StepInputs.make(ForwardMode.EXTEND, [rows[-1]], [alloc.seq_len(rows[-1])], [len(part)], loc)
                logits = model(ids(part), step, ids([len(part) - 1]))
            tokens.append([int(logits[0].float().argmax())])
        for _ in range(max_new_tokens - 1):
            loc = torch.cat([alloc.extend(row, 1) for row in rows])
            step = StepInputs.make(ForwardMode.DECODE, rows, [alloc.seq_len(row) for row in rows], [1] * len(rows),
                                   loc)
            best = model(ids([t[-1] for t in tokens]), step, ids(list(range(len(rows))))).float().argmax(-1).tolist()
            for t, b in zip(tokens, best):
                t.append(b)
    finally:
        for row in rows:
            alloc.free(row)
    return tokens
