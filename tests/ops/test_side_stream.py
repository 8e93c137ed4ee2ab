"""The side-stream flag of the cache writes and ``dsv4::join_side_stream`` off CUDA: the flag
changes nothing a write does (positional or by keyword), the join does nothing and refuses bad
arguments by name, and only ops that return nothing take the flag. The CUDA behaviour (a fork onto
the side stream, the wait) is checked in ``tests/gpu/test_side_stream_gpu.py``."""

import pytest
import torch

from dsv4_compile import layout
from dsv4_compile.ops._library import dsv4_op

ops = torch.ops.dsv4
PAGE = 4


def _write_args():
    gen = torch.Generator().manual_seed(0)
    cache = torch.randint(0, 256, (3, layout.model1_page_bytes(PAGE)), generator=gen, dtype=torch.uint8)
    return cache, torch.tensor([1, -1, 9, 6]), torch.randn(4, 512, generator=gen).bfloat16()


@pytest.mark.parametrize("how", ["positional", "keyword"])
def test_flag_changes_nothing_off_cuda(how):
    cache, slots, k = _write_args()
    want = cache.clone()
    ops.store_kv(want, slots, k, PAGE)
    if how == "positional":
        ops.store_kv(cache, slots, k, PAGE, True)
    else:
        ops.store_kv(cache, slots, k, PAGE, side_stream=True)
    assert not torch.equal(want, _write_args()[0]) and torch.equal(cache, want)


def test_join_does_nothing_off_cuda():
    cache, slots, k = _write_args()
    before = cache.clone()
    ops.join_side_stream([cache], [k, slots])
    assert torch.equal(cache, before)


@pytest.mark.parametrize("written, keepalive, error, match", [
    ([], [], ValueError, "written must hold"),
    ("cache", [torch.zeros(2, device="meta")], ValueError, r"keepalive\[0\] is on meta"),
])
def test_join_refuses_bad_arguments_by_name(written, keepalive, error, match):
    cache = _write_args()[0]
    with pytest.raises(error, match=match):
        ops.join_side_stream([cache] if written == "cache" else written, keepalive)


def test_only_ops_returning_nothing_take_the_flag():
    with pytest.raises(ValueError, match="returns nothing"):
        @dsv4_op("side_stream_returning", check=lambda x: None, fake=lambda x: x, side_stream=True)
        def returning(x: torch.Tensor) -> torch.Tensor:
            return x.clone()
