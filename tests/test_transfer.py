"""``transfer.to_device``: a step's integer vectors as tensors of their dtypes, views of one copy."""

import pytest
import torch

from dsv4_compile.transfer import to_device

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


@pytest.mark.parametrize("device", DEVICES)
def test_vectors_arrive_in_their_dtypes_as_views_of_one_buffer(device):
    int64 = [[5, -1, 2**40], [], [7]]
    int32 = [[1, 2, 3], [2**31 - 1], []]
    out = to_device(torch.device(device), int64=int64, int32=int32)
    assert [t.dtype for t in out] == [torch.int64] * 3 + [torch.int32] * 3
    assert [t.tolist() for t in out] == int64 + int32
    assert all(t.device.type == device and t.is_contiguous() and t.dim() == 1 for t in out)
    assert len({t.untyped_storage().data_ptr() for t in out}) == 1  # one copy
    assert all(t.data_ptr() % t.element_size() == 0 for t in out)  # each view aligned to its dtype


def test_nothing_to_send():
    assert to_device(torch.device("cpu")) == []
    (empty,) = to_device(torch.device("cpu"), int32=[[]])
    assert empty.shape == (0,) and empty.dtype == torch.int32
