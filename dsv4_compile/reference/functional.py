"""Small math shared by the references, the layer and the oracle: RMSNorm, RoPE (and the two
fused, ``dsv4::rms_norm_rope``), Walsh-Hadamard, the bounded gather every reference reads index
maps, rings and caches through, and the masked row write the caches and rings are written with.

All compute in fp32 and return the input dtype unless stated.
"""

from __future__ import annotations

import functools
import math
import operator

import torch


def row_chunks(num_rows: int, chunk: int) -> list[tuple[int, int]]:
    """``[lo, hi)`` bounds of ``num_rows`` rows taken ``chunk`` at a time (bounding a reference's
    dense working set when it runs eagerly). While a graph is traced (``torch.export`` with the
    references substituted for the ops, :mod:`dsv4_compile.export`) the row count is symbolic and
    a loop over it would specialise it: one chunk of every row then."""
    if torch.compiler.is_compiling():
        return [(0, num_rows)]
    return [(lo, min(lo + chunk, num_rows)) for lo in range(0, num_rows, chunk)]


def may_select(t: torch.Tensor) -> bool:
    """Whether a reference may make tensors whose size depends on ``t``'s values (``torch.unique``,
    boolean selection) to skip work: eagerly on the CPU. On other devices that would sync the host
    and break CUDA-graph capture; while a graph is traced, stop the trace."""
    return t.device.type == "cpu" and not torch.compiler.is_compiling()


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    """``x * rsqrt(mean(x^2) + eps) * weight`` over the last dim (fp32 math, input dtype out)."""
    xf = x.float()
    y = xf * torch.rsqrt(xf.pow(2).mean(dim=-1, keepdim=True) + eps)
    if weight is not None:
        y = y * weight.float()
    return y.to(x.dtype)


def apply_rope(x: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor,
               inverse: bool = False) -> torch.Tensor:
    """Interleaved-pair (GPT-J) RoPE on the last dim of ``x`` (docs/semantics.md §1.2).

    x: [..., 64]; positions: int tensor broadcastable to ``x.shape[:-1]``; inv_freq: [32] fp32.
    Pairs ``(x[2i], x[2i+1])`` are multiplied by ``exp(j * pos * inv_freq[i])`` (by its conjugate
    when ``inverse``). Angles are ``float32(pos) * inv_freq`` as in the model's freqs_cis table.
    """
    angle = positions.float().unsqueeze(-1) * inv_freq.float()  # [..., 32]
    cos, sin = torch.cos(angle), torch.sin(angle)
    if inverse:
        sin = -sin
    pairs = x.float().unflatten(-1, (-1, 2))
    x0, x1 = pairs[..., 0], pairs[..., 1]
    out = torch.stack([x0 * cos - x1 * sin, x0 * sin + x1 * cos], dim=-1).flatten(-2)
    return out.to(x.dtype)


def rope_tail(x: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor,
              inverse: bool = False) -> torch.Tensor:
    """Apply RoPE to the last 64 dims of ``x`` and return the whole vector."""
    rope_dim = 2 * inv_freq.shape[-1]
    return torch.cat([x[..., :-rope_dim], apply_rope(x[..., -rope_dim:], positions, inv_freq, inverse)],
                     dim=-1)


def rms_norm_rope(x: torch.Tensor, weight: torch.Tensor | None, eps: float, round_scale: bool,
                  positions: torch.Tensor, inv_freq: torch.Tensor) -> torch.Tensor:
    """RMSNorm over the last dim, then RoPE on its last ``2 * len(inv_freq)`` dims at each
    token's position: a layer's query (per head) and key before they are cached or attended.

    x: [T, D] or [T, H, D]; positions: [T] int (one per token, shared by its heads); weight: [D]
    or None. ``round_scale`` (no weight): the scale ``rsqrt(mean(x^2) + eps)`` is rounded to x's
    dtype and multiplied in it, as ``transformers``' unweighted DeepSeek V4 norm does; otherwise
    :func:`rms_norm`.
    """
    if round_scale:
        y = x * torch.rsqrt(x.float().pow(2).mean(dim=-1, keepdim=True) + eps).to(x.dtype)
    else:
        y = rms_norm(x, weight, eps)
    return rope_tail(y, positions.view(-1, *[1] * (x.dim() - 2)), inv_freq)


def hadamard_matrix(n: int, device: torch.device) -> torch.Tensor:
    """Unscaled Sylvester Hadamard matrix ``[n, n]`` fp32, built once per device (so a CUDA-graph
    capture never sees the host-to-device copy); built afresh while a graph is traced (a cached
    tensor made under a tracer's fake mode would outlive it)."""
    if torch.compiler.is_compiling():
        return _sylvester(n).to(device)
    return _cached_hadamard_matrix(n, device)


@functools.lru_cache(maxsize=None)
def _cached_hadamard_matrix(n: int, device: torch.device) -> torch.Tensor:
    return _sylvester(n).to(device)


def _sylvester(n: int) -> torch.Tensor:
    h = torch.ones(1, 1)
    while h.shape[0] < n:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return h


def hadamard(x: torch.Tensor) -> torch.Tensor:
    """Sylvester-ordered Walsh-Hadamard transform over the last dim, scaled by ``n**-0.5`` (fp32)."""
    n = x.shape[-1]
    if n & (n - 1):
        raise ValueError(f"hadamard needs a power-of-two last dim, got {n}")
    return (x.float() @ hadamard_matrix(n, x.device)) * (1.0 / math.sqrt(n))


def gather_or(table: torch.Tensor, index: tuple[torch.Tensor, ...], fill: float) -> torch.Tensor:
    """``table[index]`` where every index lies inside its dimension of ``table``, ``fill`` where
    one does not (docs/semantics.md §6): no ``IndexError``, no wrap-around of negative values.

    index: one integer tensor per leading dim of ``table``, broadcastable together. Returns
    ``broadcast shape + table.shape[len(index):]`` in ``table``'s dtype.
    """
    dims = table.shape[:len(index)]
    ok = functools.reduce(operator.and_, [(i >= 0) & (i < n) for i, n in zip(index, dims)])
    trailing = table.shape[len(index):]
    if any(n == 0 for n in dims):  # nothing to read
        return torch.full((*ok.shape, *trailing), fill, dtype=table.dtype, device=table.device)
    got = table[tuple(torch.where(ok, i.long(), 0) for i in index)]
    return torch.where(ok.view(*ok.shape, *(1 for _ in trailing)), got, fill)


def put_where(target: torch.Tensor, index: tuple[torch.Tensor, ...], values: torch.Tensor,
              valid: torch.Tensor) -> None:
    """``target[index][n] = values[n]`` where ``valid[n]``, nothing written elsewhere, without a
    host sync or a data-dependent shape (CUDA-graph safe).

    One ``index_put_`` writes every row, so a skipped row needs a target too: it repeats the first
    valid row's write (same index, same values), or, with no valid row, writes back what its own
    index holds. Every index written twice in the call then receives identical values, so the
    result does not depend on the order of duplicate writes (a skipped row sent to a fixed dummy
    index could otherwise undo a valid row's write there).

    index: one int64 tensor ``[N]`` per leading dim of ``target``, every entry inside its dim
    (callers map skipped rows anywhere in range); values: ``[N, ...]``; valid: bool ``[N]``.
    """
    if valid.shape[0] == 0:
        return
    # [1], not a 0-d index: indexing by a 0-d tensor reads its value on the host (a data-dependent
    # scalar that torch.export cannot trace); a one-element index stays a tensor op
    first = valid.int().argmax(0, keepdim=True)  # 0 when no row is valid
    index = tuple(torch.where(valid, i, i[first]) for i in index)
    rows = (-1, *([1] * (values.dim() - 1)))
    fill = torch.where(valid[first].view(rows), values[first], target[tuple(i[first] for i in index)])
    target[index] = torch.where(valid.view(rows), values, fill)
