"""What one step may write: per cache buffer, a mask of the bytes / rows its own tokens own.

Derived on the host from the step and the allocator's index maps only (never from the metadata
ops, whose outputs are what is being checked): the step's full slots, the SWA slots
``full_to_swa`` gives them, the compressed slots of the rows that complete a window (``slot // r``
where ``(pos + 1) % r == 0``), the compressor ring rows ``req * ring + pos % ring``, and the dummy
targets padding rows write (slot 0, request 0 at position 0). A forward writes no index map.
"""

from __future__ import annotations

import torch

from dsv4_compile import DSV4Cache, StepInputs, layout
from dsv4_compile.config import INDEX_HEAD_DIM, PAGE_SIZE


def token_rows(step: StepInputs) -> list[tuple[int, int, int]]:
    """``(request row, position, full slot)`` of every query row; padding rows are ``(0, 0, 0)``."""
    rows, seqs, exts = (v.tolist() for v in (step.req_rows, step.seq_lens, step.extend_lens))
    loc = step.out_cache_loc.tolist()
    out = [(row, p, 0) for row, seq, ext in zip(rows, seqs, exts) for p in range(seq - ext, seq)]
    out = [(row, p, loc[i]) for i, (row, p, _) in enumerate(out)]
    return out + [(0, 0, 0)] * (len(loc) - len(out))


def _model1_mask(mask: torch.Tensor, slots: list[int], page_size: int) -> None:
    """Mark the data and scale bytes of MODEL1 ``slots`` in ``mask [pages, page bytes]``."""
    for slot in slots:
        page, off = divmod(slot, page_size)
        at = layout.model1_offsets(page_size, off)
        mask[page, at.nope:at.nope + layout.TOKEN_DATA_BYTES] = True
        mask[page, at.scales:at.scales + layout.TOKEN_SCALE_BYTES] = True


def _index_mask(mask: torch.Tensor, slots: list[int]) -> None:
    """Mark the fp8 values and the fp32 scale of indexer key ``slots``."""
    p = layout.INDEX_PAGE_SIZE
    for slot in slots:
        page, off = divmod(slot, p)
        mask[page, off * INDEX_HEAD_DIM:(off + 1) * INDEX_HEAD_DIM] = True
        scale = p * INDEX_HEAD_DIM + 4 * off
        mask[page, scale:scale + 4] = True


def step_footprint(cache: DSV4Cache, step: StepInputs) -> dict[str, torch.Tensor]:
    """Per buffer name of ``cache.state_dict()``, a bool mask (the buffer's shape) of what ``step``
    may change."""
    tokens = token_rows(step)
    swa = cache.full_to_swa[torch.tensor([s for _, _, s in tokens], dtype=torch.long)].tolist()
    compresses = step.mode.needs_compress
    masks = {name: torch.zeros(buf.shape, dtype=torch.bool) for name, buf in cache.state_dict().items()}
    for i, layer in enumerate(cache.layers):
        name = f"layers.{i}."
        _model1_mask(masks[name + "swa_kv"], swa, PAGE_SIZE)
        r = layer.ratio
        if r == 0 or not compresses:
            continue
        done = [s // r for _, p, s in tokens if (p + 1) % r == 0]
        _model1_mask(masks[name + "extra_kv"], done, layer.extra_page_size)
        ring_rows = [row * layer.ring + p % layer.ring for row, p, _ in tokens]
        for state in ("kv_state", "index_state"):
            if name + state in masks:
                masks[name + state][ring_rows] = True
        if r == 4:
            _index_mask(masks[name + "index_k"], done)
    return masks


def assert_only_footprint_changed(before: dict[str, torch.Tensor], cache: DSV4Cache,
                                  footprint: dict[str, torch.Tensor], what: str) -> None:
    """Every element of every buffer outside ``footprint`` equals its snapshot ``before``."""
    for name, after in cache.state_dict().items():
        stray = (before[name] != after) & ~footprint[name]
        assert not stray.any(), f"{what} changed {int(stray.sum())} elements of {name} outside its own slots " \
                                f"(first at {stray.nonzero()[0].tolist()})"
