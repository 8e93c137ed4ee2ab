"""Every Triton kernel launch of the interpreter suite, compiled for the H200 (sm_90) without a GPU.

The Triton interpreter runs a kernel as Python: it does not type-check it the way the compiler
does (a value carried through a loop that changes type, a constexpr used as a tensor), so a kernel
can pass every interpreter test and still fail to compile on the GPU. Here the interpreter run
records each distinct launch (kernel, argument types, scalar and constexpr values, compile
options) and a second process, without the interpreter, compiles each one with Triton's own
compiler for sm_90 (front end to PTX and ``ptxas``; no driver or GPU is needed), specialised as a
GPU launch of those arguments is (integers of 1 as constants, integers divisible by 16 and tensors
marked so): the code the GPU runs, whose register allocation can differ from the unspecialised
kernel's (a kernel that spilled only so specialised: docs/perf-log.md, 2026-12-06).

What it covers: the variants the interpreter suite runs, with the constexprs the launchers pick
there. Where a launcher picks by ``INTERPRET`` or by the device (software fp8 conversion, fp32
dots, PDL off) the GPU's own choice is not compiled, and kernels the interpreter never launches
(the warp-specialised attention kernel) are not either; those are compiled by the GPU tests.
The scalars are the suite's small shapes (K = 72, say, where the model has 4,096), so what depends
on them (whether a loop is software-pipelined, register pressure, spills) can differ from the
model's build: for those questions, compile the launch with the model's scalars in place.

    TRITON_INTERPRET=1 DSV4_RECORD_KERNEL_LAUNCHES=launches.json pytest tests/interpret
    python -m tests.support.kernel_launches launches.json     # prints failures, exits 1 on any
    python -m tests.support.kernel_launches launches.json --local-memory    # and the variants that spill
"""

from __future__ import annotations

import argparse
import atexit
import dataclasses
import functools
import importlib
import inspect
import json
import os
import re
import subprocess
import sys
import tempfile
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import torch

RECORD_ENV = "DSV4_RECORD_KERNEL_LAUNCHES"
_LAUNCH_ONLY = ("grid", "warmup")


def _arg_record(value):
    """A launch argument as JSON: a tensor by its dtype, a tuple (a ``NamedTuple`` of arguments)
    element by element, a Triton dtype by its name, a scalar by its value."""
    if isinstance(value, torch.Tensor):
        return {"tensor": str(value.dtype).removeprefix("torch.")}
    if isinstance(value, tuple):
        return {"tuple": [_arg_record(v) for v in value], "class": f"{type(value).__module__}:{type(value).__qualname__}"}
    if value is None or isinstance(value, (bool, int, float, str)):
        return {"value": value}
    import triton.language as tl

    if isinstance(value, tl.dtype):
        return {"tl_dtype": value.name}
    return {"value": repr(value), "unsupported": type(value).__name__}


def _mock(record):
    """The argument a recorded one stands for, as the compiler's type inference takes it."""
    from triton.runtime.jit import MockTensor

    if "unsupported" in record:
        raise TypeError(f"a {record['unsupported']} argument is not recorded")
    if "tensor" in record:
        return MockTensor(getattr(torch, record["tensor"]))
    if "tl_dtype" in record:
        import triton.language as tl

        return tl.dtype(record["tl_dtype"])
    if "tuple" in record:
        module, name = record["class"].split(":")
        cls = getattr(importlib.import_module(module), name)
        items = [_mock(r) for r in record["tuple"]]
        return cls(*items) if hasattr(cls, "_fields") else cls(items)
    return record["value"]


def _type_of(arg):
    """The compiler's type string of an argument; a ``NamedTuple``'s keeps its class, whose field
    names the kernel reads the elements by."""
    from triton.runtime.jit import mangle_type

    if isinstance(arg, tuple):
        items = [_type_of(a) for a in arg]
        return type(arg)(*items) if hasattr(arg, "_fields") else tuple(items)
    return mangle_type(arg)


def start_recording(path: str) -> None:
    """Record every interpreted launch from now on; write the distinct ones to ``path`` at exit."""
    from triton.runtime.interpreter import InterpretedFunction

    seen: dict[str, dict] = {}
    run = InterpretedFunction.run

    def recording_run(self, *args, **kwargs):
        fn = self.fn
        launch = {"module": fn.__module__, "kernel": fn.__qualname__,
                  "args": [_arg_record(a) for a in args],
                  "kwargs": {k: _arg_record(v) for k, v in kwargs.items() if k not in _LAUNCH_ONLY}}
        seen.setdefault(json.dumps(launch, sort_keys=True), launch)
        return run(self, *args, **kwargs)

    InterpretedFunction.run = recording_run
    atexit.register(lambda: Path(path).write_text(json.dumps(list(seen.values()), indent=0)))


def _jit_function(launch: dict):
    fn = getattr(importlib.import_module(launch["module"]), launch["kernel"])
    while not hasattr(fn, "params"):  # an autotuner or heuristics wrapper
        fn = fn.fn
    return fn


def _specialised(param, arg) -> tuple[object, list]:
    """``(type, attributes)`` of a non-constexpr argument as a GPU launch specialises it: an integer
    of 1 becomes the constant 1, an integer divisible by 16 and a tensor are marked divisible by 16
    (the recorded tensor stands for an allocation, which is 16-byte aligned); a tuple by its types."""
    from triton.backends.compiler import BaseBackend
    from triton.runtime.jit import native_specialize_impl

    if isinstance(arg, tuple):
        return _type_of(arg), []
    kind, key = native_specialize_impl(BaseBackend, arg, param.is_const, not param.do_not_specialize,
                                       not param.do_not_specialize_on_alignment)
    return kind, BaseBackend.parse_attr(key) if isinstance(key, str) else []


def compile_spec(launch: dict):
    """``(kernel, signature, constexprs, attributes, options)`` of one recorded launch: what the
    compiler sees, specialised as a GPU launch of the same arguments is (scalar values other than
    constexprs only by their type, and whether they are 1 or divisible by 16)."""
    from triton.backends.nvidia.compiler import CUDAOptions

    fn = _jit_function(launch)
    defaults = {name: p.default for name, p in inspect.signature(fn.fn).parameters.items()}
    values = dict(zip(fn.arg_names, launch["args"]))
    values.update({k: v for k, v in launch["kwargs"].items() if k in defaults})
    option_names = {f.name for f in dataclasses.fields(CUDAOptions)}
    options = {k: v["value"] for k, v in launch["kwargs"].items() if k not in defaults and k in option_names}
    signature, constexprs, attrs = {}, {}, {}
    for i, param in enumerate(fn.params):
        arg = _mock(values[param.name]) if param.name in values else defaults[param.name]
        kind = "constexpr"
        if not param.is_constexpr:
            kind, attrs[(i,)] = _specialised(param, arg)
        signature[param.name] = kind
        if kind == "constexpr":
            constexprs[(i,)] = arg
    return fn, signature, constexprs, attrs, options


def local_memory_use(ptx: str) -> str | None:
    """ptxas's resource line of a kernel compiled for sm_90 where it uses a stack frame (local
    memory: spilled registers, or arrays indexed at run time), else None."""
    from triton.backends.nvidia.compiler import get_ptxas

    with tempfile.NamedTemporaryFile("w", suffix=".ptx") as src:
        src.write(ptx)
        src.flush()
        log = subprocess.run([get_ptxas(90).path, "-v", "--gpu-name=sm_90a", src.name, "-o", os.devnull],
                             capture_output=True, text=True).stderr
    frame = re.search(r"(\d+) bytes stack frame, (\d+) bytes spill stores", log)
    registers = re.search(r"Used (\d+) registers", log)
    if not (frame and int(frame.group(1))):
        return None
    return f"{registers.group(1)} registers, {frame.group(1)} bytes of stack, {frame.group(2)} bytes of spill stores"


def compile_for_sm90(launch: dict):
    """``(compiled kernel, compile_spec)`` of one recorded launch, built by Triton for sm_90."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    spec = compile_spec(launch)
    fn, signature, constexprs, attrs, options = spec
    kernel = triton.compile(ASTSource(fn=fn, signature=signature, constexprs=constexprs, attrs=attrs),
                            target=GPUTarget("cuda", 90, 32), options=options)
    return kernel, spec


def _compile(launch: dict, local_memory: bool = False) -> tuple[str | None, str | None]:
    """Compile one launch's variant for sm_90: ``(failure, local memory)``, each None or a line
    naming the variant; the local memory only when asked for."""
    name = f"{launch['module']}.{launch['kernel']}"
    try:
        kernel, (fn, _, constexprs, _, options) = compile_for_sm90(launch)
    except Exception as e:  # noqa: BLE001 - every compiler error is a finding
        return f"{name}: {type(e).__name__}: {str(e)[:2000]}", None
    used = local_memory_use(kernel.asm["ptx"]) if local_memory else None
    if used is None:
        return None, None
    constants = ", ".join(f"{fn.arg_names[i]}={v}" for (i,), v in sorted(constexprs.items()) if v is not None)
    return None, f"{name}({constants}, {options}): {used}"


def compile_all(path: str, local_memory: bool = False) -> tuple[int, list[str], list[str]]:
    """``(kernel variants compiled, failures, variants using local memory)`` of the launches
    recorded in ``path``: each distinct ``compile_spec`` compiled once for sm_90, on every core
    (with ``local_memory`` each also through ``ptxas -v``)."""
    variants: dict[str, dict] = {}
    for launch in json.loads(Path(path).read_text()):
        try:
            fn, signature, constexprs, attrs, options = compile_spec(launch)
        except TypeError:
            key = json.dumps(launch, sort_keys=True)  # compiled alone, to report what is unsupported
        else:
            key = repr((launch["module"], launch["kernel"], sorted(signature.items()), sorted(constexprs.items()),
                        sorted(attrs.items()), sorted(options.items())))
        variants.setdefault(key, launch)
    with ProcessPoolExecutor(os.cpu_count()) as pool:
        results = list(pool.map(functools.partial(_compile, local_memory=local_memory), variants.values()))
    return len(variants), [f for f, _ in results if f], sorted(m for _, m in results if m)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description="Compile the recorded launches for sm_90.")
    parser.add_argument("launches", help="the JSON the interpreter suite recorded")
    parser.add_argument("--local-memory", action="store_true",
                        help="also list the variants whose compiled kernel uses a stack frame (spills)")
    args = parser.parse_args()
    count, failed, local = compile_all(args.launches, args.local_memory)
    print(f"{count} kernel variants compiled for sm_90, {len(failed)} failed")
    for line in failed:
        print(line)
    if args.local_memory:
        print(f"{len(local)} of them use local memory:")
        for line in local:
            print(line)
    sys.exit(1 if failed else 0)
