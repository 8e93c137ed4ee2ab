"""The step object — the single input describing one forward — and the metadata derived from it.

:class:`StepInputs` holds four device tensors and a static :class:`ForwardMode`. It is a registered
pytree (the mode is its static context), so it passes through ``torch.compile`` and
``torch.export`` as plain tensor inputs. :func:`build_step_metadata` turns it into every
per-step tensor the layers need by calling ``dsv4::`` metadata ops: a pure function of the step
and the cache index maps, computed once per step and shared by all layers. The bucket sizes a
step is padded to (so that few distinct shapes are compiled) live here too.

Conventions (the same in every mode):

* ``seq_lens`` are *post-step* lengths (they include this step's tokens; for target verify that
  is committed length + draft tokens).
* ``extend_lens`` are this step's tokens per request (decode 1, uniform verify D, ragged verify
  ``verify_lens``, prefill the chunk length).
* ``out_cache_loc`` has one full slot per query row, requests concatenated; its length ``T`` may
  exceed ``sum(extend_lens)``: the tail rows are padding and must hold 0 (the dummy slot).
* Padded requests (bucketing) use request row 0 with ``seq_len = extend_len = 0``.
"""

from __future__ import annotations

import bisect
import enum
from collections.abc import Sequence
from dataclasses import dataclass, field, fields, make_dataclass
from typing import TYPE_CHECKING

import torch
import torch.utils._pytree as pytree

from . import ops  # noqa: F401  (registers the dsv4:: ops build_step_metadata calls)
from .config import DSV4AttnConfig
from .counts import check_count
from .metadata_chain import FIELDS, run_chain

if TYPE_CHECKING:
    from .cache import DSV4Cache

# Request counts (decode) and token counts (verify / extend) a step is padded up to.
REQUEST_BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 160, 192, 224, 256)
TOKEN_BUCKETS = REQUEST_BUCKETS + (320, 384, 448, 512, 640, 768, 896, 1024)


def bucket(n: int, buckets: Sequence[int]) -> int:
    """The smallest bucket >= ``n`` (``n`` itself past the largest bucket)."""
    i = bisect.bisect_left(buckets, n)
    return buckets[i] if i < len(buckets) else n


class ForwardMode(enum.Enum):
    DECODE = "decode"
    TARGET_VERIFY = "target_verify"
    EXTEND = "extend"  # prefill and chunked prefill
    DRAFT_EXTEND = "draft_extend"  # draft (SWA-only) model over accepted tokens: no compression
    IDLE = "idle"  # no real request: every row is padding

    @property
    def needs_compress(self) -> bool:
        return self is not ForwardMode.DRAFT_EXTEND


@dataclass
class StepInputs:
    """One forward's description. B = requests, T = query rows (>= sum(extend_lens)).

    req_rows: [B] int32 request rows of the cache; seq_lens: [B] int32 post-step lengths;
    extend_lens: [B] int32 tokens this step; out_cache_loc: [T] int64 full slots (0 for padding).
    """

    mode: ForwardMode
    req_rows: torch.Tensor
    seq_lens: torch.Tensor
    extend_lens: torch.Tensor
    out_cache_loc: torch.Tensor

    @property
    def num_tokens(self) -> int:
        return self.out_cache_loc.shape[0]

    @property
    def batch_size(self) -> int:
        return self.req_rows.shape[0]

    def tensors(self) -> tuple[torch.Tensor, ...]:
        return self.req_rows, self.seq_lens, self.extend_lens, self.out_cache_loc

    @classmethod
    def make(cls, mode: ForwardMode, req_rows, seq_lens, extend_lens, out_cache_loc, *,
             num_tokens: int | None = None, device=None) -> "StepInputs":
        """Build from Python sequences or tensors of integers, padding ``out_cache_loc`` with 0 to
        ``num_tokens`` rows (a bucket size) when given. A mode that is not a ``ForwardMode``,
        non-integer values or per-request lists of different lengths raise, naming the argument."""
        check_mode(mode)
        per_request = {name: _index_vector(name, v, torch.int32, device) for name, v in
                       (("req_rows", req_rows), ("seq_lens", seq_lens), ("extend_lens", extend_lens))}
        if len({t.shape[0] for t in per_request.values()}) > 1:
            raise ValueError(f"req_rows, seq_lens and extend_lens need the same length, got "
                             f"{[t.shape[0] for t in per_request.values()]}")
        loc = _index_vector("out_cache_loc", out_cache_loc, torch.int64, device)
        if num_tokens is not None:
            check_count("num_tokens", num_tokens)
            if num_tokens < loc.shape[0]:
                raise ValueError(f"num_tokens={num_tokens} is less than the {loc.shape[0]} real tokens")
            loc = torch.cat([loc, loc.new_zeros(num_tokens - loc.shape[0])])
        return cls(mode, *per_request.values(), loc)

    @classmethod
    def idle(cls, num_tokens: int = 0, device=None) -> "StepInputs":
        """A step of ``num_tokens`` padding rows and no request."""
        check_count("num_tokens", num_tokens)
        empty = torch.zeros(0, dtype=torch.int32, device=device)
        return cls(ForwardMode.IDLE, empty, empty, empty,
                   torch.zeros(num_tokens, dtype=torch.int64, device=device))


def check_mode(mode) -> None:
    """``TypeError`` naming ``mode`` unless it is a :class:`ForwardMode`."""
    if not isinstance(mode, ForwardMode):
        raise TypeError(f"mode must be a ForwardMode, got {type(mode).__name__}")


def check_step(step) -> None:
    """``TypeError`` naming ``step`` unless it is a :class:`StepInputs`."""
    if not isinstance(step, StepInputs):
        raise TypeError(f"step must be a StepInputs, got {type(step).__name__}")


def _index_vector(name: str, values, dtype: torch.dtype, device) -> torch.Tensor:
    """``values`` (integers: a sequence, a scalar or a 0-d / 1-D tensor) as a 1-D ``dtype`` tensor;
    a value outside ``dtype``'s range is refused (a cast would wrap it onto another row or length)."""
    try:
        t = torch.as_tensor(values, device=device)
    except (OverflowError, RuntimeError, ValueError) as e:  # an integer past int64
        raise ValueError(f"{name}: {e}") from None
    if t.numel() and (t.is_floating_point() or t.is_complex() or t.dtype == torch.bool):
        raise TypeError(f"{name} must hold integers, got {t.dtype}")
    if t.dim() > 1:
        raise ValueError(f"{name} must be 1-D, got shape {tuple(t.shape)}")
    limits = torch.iinfo(dtype)
    if t.numel() and t.dtype != dtype and not (limits.min <= int(t.min()) and int(t.max()) <= limits.max):
        raise ValueError(f"{name} holds values outside {dtype}'s range [{limits.min}, {limits.max}]")
    return t.to(dtype).reshape(-1)


pytree.register_pytree_node(
    StepInputs,
    lambda s: (list(s.tensors()), s.mode),
    lambda values, mode: StepInputs(mode, *values),
    serialized_type_name="dsv4_compile.StepInputs",
    to_dumpable_context=lambda mode: mode.value,
    from_dumpable_context=lambda value: ForwardMode(value),
    flatten_with_keys_fn=lambda s: ([(pytree.GetAttrKey(f.name), getattr(s, f.name))
                                     for f in fields(s) if f.name != "mode"], s.mode),
)


def _step_metadata_class() -> type:
    """``StepMetadata``: one attribute per field of ``metadata_chain.FIELDS`` (keyword-only; a field
    of compression ratio r defaults to None, as it is built only for stacks with ratio-r layers in
    a mode that compresses)."""
    attributes = []
    for f in FIELDS:
        attributes.append((f.name, torch.Tensor | None, field(default=None)) if f.ratio else (f.name, torch.Tensor))
    doc = "\n".join(["Per-step tensors shared by every layer (docs/semantics.md §3), all int32; T rows, "
                     "NP pages per request, W = 128, K = ceil64(2 NP).", "",
                     *(f"{f.name}: {f.doc}" + (f" (None without ratio-{f.ratio} layers)" if f.ratio else "")
                       for f in FIELDS)])
    return make_dataclass("StepMetadata", attributes, kw_only=True,
                          namespace={"__doc__": doc, "__module__": __name__})


StepMetadata = _step_metadata_class()


def build_step_metadata(step: StepInputs, cache: "DSV4Cache", config: DSV4AttnConfig) -> StepMetadata:
    """All metadata of one step from the cache's index maps, through ``dsv4::`` ops (no host reads):
    the ratio-4 / ratio-128 fields when the stack has such layers and the mode compresses."""
    ratios = set(config.compress_ratios) if step.mode.needs_compress else set()
    out = run_chain(torch.ops.dsv4, *step.tensors(), cache.req_to_token, cache.req_to_page, cache.full_to_swa,
                    config.index_topk, ratios)
    return StepMetadata(**out)

