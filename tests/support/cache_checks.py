"""Cache contents: exact comparison of two caches, snapshots, and what an idle step may write."""

from __future__ import annotations

from collections.abc import Iterable

import torch

from dsv4_compile import DSV4Cache, PageAllocator
from dsv4_compile.engine import Engine


def assert_caches_equal(a: torch.nn.Module, b: torch.nn.Module) -> None:
    for (name, x), y in zip(a.state_dict().items(), b.state_dict().values()):
        assert torch.equal(x, y), f"cache buffer {name} differs ({(x != y).float().mean().item():.2%} of elements)"


INDEX_MAPS = ("req_to_token", "req_to_page", "full_to_swa")


def snapshot(cache: DSV4Cache, names: Iterable[str] | None = None) -> dict[str, torch.Tensor]:
    """A copy of every buffer of ``cache`` (pools, compressor rings, index maps), by name; only
    those of ``names`` when given."""
    return {name: buf.clone() for name, buf in cache.state_dict().items() if names is None or name in names}


def assert_unchanged(before: dict[str, torch.Tensor], cache: DSV4Cache, what: str = "the call") -> None:
    """Every buffer of ``cache`` in the ``snapshot`` ``before`` is byte-identical to it."""
    buffers = cache.state_dict()
    for name, old in before.items():
        assert torch.equal(old, buffers[name]), f"{what} changed cache buffer {name}"


def allocator_state(allocator: PageAllocator) -> tuple:
    """Everything a :class:`PageAllocator` decides from, as a comparable value: each request's
    length, longest length and pages, and the free rows and pages in hand-out order."""
    requests = tuple((row, r.seq_len, r.high_water, tuple(r.full_pages), tuple(sorted(r.swa_pages.items())))
                     for row, r in sorted(allocator._requests.items()))
    return requests, tuple(allocator._free_rows), tuple(allocator._free_full), tuple(allocator._free_swa)


def _dummy_rows(cache: DSV4Cache) -> dict[str, int]:
    """Per buffer name, the leading rows padding rows may write: page 0 of every pool (slot 0 is
    the dummy target) and request 0's rows of every compressor ring. Absent: none (index maps)."""
    rows = {}
    for i, layer_cache in enumerate(cache.layers):
        for name, _ in layer_cache.named_buffers():
            rows[f"layers.{i}.{name}"] = layer_cache.ring if name.endswith("_state") else 1
    return rows


def assert_idle_step_is_inert(engine: Engine, num_tokens: int) -> torch.Tensor:
    """Run ``engine.idle(num_tokens)`` and check what its rows, all padding, must do: each row's
    input is zero and it sees only its own zero key on the dummy slot, so its output is exactly
    zero; it writes nothing but the dummy targets (every index map and every other byte of every
    pool and ring is unchanged). Returns the outputs ``[num_tokens, hidden]``."""
    cache = engine.stack.cache
    before = snapshot(cache)
    out = engine.idle(num_tokens)
    assert out.shape == (num_tokens, engine.stack.config.hidden_size)
    assert torch.equal(out, torch.zeros_like(out)), f"idle outputs are not zero (max |out| {out.abs().max()})"
    dummy = _dummy_rows(cache)
    for name, after in cache.state_dict().items():
        skip = dummy.get(name, 0)
        assert torch.equal(before[name][skip:], after[skip:]), f"an idle step wrote {name} outside its dummy rows"
    return out
