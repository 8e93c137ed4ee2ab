"""Registering a ``dsv4::`` op once: schema, argument check, reference kernel, CUDA kernel, fake.

An op family module states each op as one decorated function::

    @dsv4_op("store_kv", check=_check_store_kv, fake=_store_kv_fake, cuda=_store_kv_cuda,
             mutates_args=("cache",))
    def store_kv(cache: torch.Tensor, slots: torch.Tensor, k: torch.Tensor, page_size: int) -> None:
        ref.store_model1(cache, slots, k, page_size)

The decorated function's signature is the op schema and its body the reference, registered as the
kernel of every device. ``check`` runs before every implementation — reference, CUDA and fake —
so a bad argument fails with the same error eagerly, under tracing and in a compiled graph's
fake pass. ``cuda`` (same signature as the op) is registered as the CUDA kernel only where
Triton is installed; elsewhere the reference stays the kernel on every device.

Where Triton is not installed (platforms it does not support) no CUDA kernel is registered: the
package still imports and every op runs its reference.

:class:`traced_references` makes the ops run as their (checked) reference code inside its block,
so that a trace records the reference's aten ops instead of the op: what ``torch.export`` needs
for a program that runs with libtorch alone (:mod:`dsv4_compile.export`).

An op that only writes its mutated arguments may be registered with ``side_stream=True``: its
schema gains a last argument ``bool side_stream=False``, and a CUDA call with it set launches on
the device's side stream (:mod:`.side_stream`), where ``OverlapCacheWritesPass`` puts a step's
cache writes beside the projections they do not wait for.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Sequence

import torch
from torch.overrides import TorchFunctionMode

try:
    import triton  # noqa: F401
    HAS_TRITON = True
except ImportError:
    HAS_TRITON = False

NAMESPACE = "dsv4"
# op name -> its checked reference; ops without one (CUDA only) are absent
_REFERENCES: dict[str, Callable] = {}


def _checked(fn: Callable, check: Callable) -> Callable:
    @functools.wraps(fn)
    def run(*args, **kwargs):
        check(*args, **kwargs)
        return fn(*args, **kwargs)
    return run


def dsv4_op(name: str, *, check: Callable, fake: Callable, cuda: Callable | None = None,
            mutates_args: Sequence[str] = (), device_types: str | None = None, schema: str | None = None,
            decompose: bool | Callable[..., bool] = False, side_stream: bool = False):
    """Decorator turning a reference function into the custom op ``dsv4::<name>`` (see module doc).

    ``device_types="cuda"`` registers no reference kernel: the op then runs only on CUDA, through
    ``cuda``, or through the decorated function itself when ``cuda`` is not given. ``schema``
    (``torch.library.infer_schema`` form) replaces the one inferred from the decorated function's
    annotations: an op with another op's signature states it once.

    ``decompose=True`` (a reference of torch ops and no ``cuda`` kernel) makes the reference the
    op's decomposition in Inductor: a Dynamo trace records one node with a cheap fake where the
    model calls the op, and AOTAutograd replaces it by the reference's aten ops, so Inductor
    compiles (and fuses, and the FX passes match) what the torch ops written out would give. For
    math a layer repeats several times (RMSNorm, RoPE): each traced aten op costs Dynamo ~1.5 ms
    of a compile, once per layer and call (docs/compile.md, "Compile time: math a layer repeats,
    as one traced op"). ``decompose`` may instead be a predicate of the op's arguments: the calls
    it holds for are decomposed, the others stay the op's node in Inductor's graph and run its
    kernel (``cuda`` on CUDA), for an op whose kernel pays for some of its calls only.

    ``side_stream=True`` (an op that returns nothing) appends ``bool side_stream=False`` to the
    schema: ``cuda`` runs on the side stream when it is set (:func:`.side_stream.forked`); the
    check, the reference and the fake never see it (where no ``cuda`` kernel is registered the flag
    changes nothing).
    """
    if decompose is True and cuda is not None:
        raise ValueError(f"dsv4.{name}: an op with a CUDA kernel is decomposed only where a predicate says so")
    if side_stream and decompose:
        raise ValueError(f"dsv4.{name}: a decomposed op has no kernel to run on the side stream")

    def register(reference: Callable) -> torch.library.CustomOpDef:
        op_schema, op_check, op_fake, op_cuda = schema, check, fake, cuda
        if side_stream:
            op_schema, op_check, op_fake, op_cuda, reference = _with_side_stream(schema, mutates_args, check, fake,
                                                                                 cuda, reference)
        impl = _checked(op_cuda if device_types is not None and op_cuda is not None else reference, op_check)
        op = torch.library.custom_op(f"{NAMESPACE}::{name}", impl, mutates_args=tuple(mutates_args),
                                     device_types=device_types, schema=op_schema)
        if op_cuda is not None and device_types is None and HAS_TRITON:
            op.register_kernel("cuda")(_checked(op_cuda, op_check))
        op.register_fake(_checked(op_fake, op_check))
        if device_types is None:  # impl is the checked reference
            _REFERENCES[name] = impl
        if decompose:
            from torch._inductor.decomposition import register_decomposition
            overload = getattr(torch.ops.dsv4, name).default
            register_decomposition(overload)(
                impl if decompose is True else _decomposed_where(decompose, impl, overload))
        return op
    return register


def _with_side_stream(schema: str | None, mutates_args: Sequence[str], check: Callable, fake: Callable,
                      cuda: Callable | None, reference: Callable
                      ) -> tuple[str, Callable, Callable, Callable | None, Callable]:
    """The schema with ``bool side_stream=False`` appended, and the op's functions taking it: the
    CUDA kernel forked onto the side stream when it is set, the others called without it."""
    schema = schema or torch.library.infer_schema(reference, mutates_args=tuple(mutates_args))
    params, _, returns = schema.rpartition(") -> ")
    if returns != "()":
        raise ValueError(f"a side-stream op returns nothing, not {returns}")
    schema = f"{params}, bool side_stream=False) -> ()"
    arity = len(inspect.signature(reference).parameters)

    def without_flag(fn: Callable) -> Callable:
        @functools.wraps(fn)
        def call(*args, **kwargs):
            _split_side_stream(arity, args, kwargs)
            return fn(*args[:arity], **kwargs)
        return call

    @functools.wraps(cuda)
    def cuda_on_side_stream(*args, **kwargs):
        if not _split_side_stream(arity, args, kwargs):
            return cuda(*args[:arity], **kwargs)
        from .side_stream import forked
        with forked(_first_device(args, kwargs)):
            return cuda(*args[:arity], **kwargs)

    return (schema, without_flag(check), without_flag(fake), cuda_on_side_stream if cuda is not None else None,
            without_flag(reference))


def _split_side_stream(arity: int, args: tuple, kwargs: dict) -> bool:
    """The call's ``side_stream`` flag, taken out of ``kwargs`` (as a keyword) or read from
    ``args`` past the op's ``arity`` own arguments (positional)."""
    if "side_stream" in kwargs:
        return bool(kwargs.pop("side_stream"))
    return len(args) > arity and bool(args[arity])


def _first_device(args: tuple, kwargs: dict) -> torch.device:
    """The device of the first tensor argument: the op's (``check`` made them agree)."""
    return next(a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)).device


def _decomposed_where(predicate: Callable[..., bool], reference: Callable, op: torch._ops.OpOverload) -> Callable:
    """A decomposition running ``reference`` where ``predicate`` holds; elsewhere it declines
    (``NotImplemented``), and the tracer keeps the op's node."""
    def decomposition(*args, **kwargs):
        if predicate(*args, **kwargs):
            return reference(*args, **kwargs)
        _lowered_as_its_kernel(op)
        return NotImplemented
    return decomposition


@functools.cache
def _lowered_as_its_kernel(op: torch._ops.OpOverload) -> None:
    """Register ``op``'s lowering in Inductor: a call of its kernel, with the layout constraint of
    a custom op. Inductor makes that lowering itself for an op without a decomposition, and
    refuses an op that has one; registered when the decomposition first declines (inside an
    Inductor compile: the lowering module costs a second to import)."""
    from torch._inductor import lowering
    from torch._library.utils import get_layout_constraint_tag

    constraint = lowering.tag_to_layout_constraint(get_layout_constraint_tag(op, with_default=True))
    lowering.make_fallback(op, layout_constraint=constraint, warn=False, override_decomp=True)


class traced_references(TorchFunctionMode):
    """Inside ``with traced_references():`` every ``torch.ops.dsv4.*`` call runs its checked
    reference instead of dispatching to the op, so a tracer (``torch.export``) records plain aten
    ops, in-place cache writes included. An op with no reference (CUDA only) raises
    ``NotImplementedError`` naming it."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        namespace, _, name = _qualified_name(func).partition("::")
        if namespace != NAMESPACE:
            return func(*args, **(kwargs or {}))
        if name not in _REFERENCES:
            raise NotImplementedError(f"dsv4.{name} has no reference implementation to trace (CUDA only)")
        return _REFERENCES[name](*args, **(kwargs or {}))


def _qualified_name(func) -> str:
    """``ns::name`` of an ``OpOverloadPacket`` / ``OpOverload``; "" for anything else."""
    if isinstance(func, torch._ops.OpOverloadPacket):
        return func._qualified_op_name
    if isinstance(func, torch._ops.OpOverload):
        return func._schema.name
    return ""
