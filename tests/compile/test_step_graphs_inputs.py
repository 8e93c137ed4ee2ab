"""What a whole-step CUDA graph copies its inputs through (``dsv4_compile/step_graphs.py``), on
the CPU: the static copies a signature keeps, and the one-launch copy of a call's inputs into them
(as one integer dtype). The graphs themselves are tested on the GPU
(tests/gpu/test_cudagraph_step.py)."""

import torch

from dsv4_compile import ForwardMode, StepInputs
from dsv4_compile.step_graphs import _copy_in, _static_copy


def _step(rows, seq_lens, loc) -> StepInputs:
    return StepInputs.make(ForwardMode.DECODE, rows, seq_lens, [1] * len(rows), loc)


def test_one_launch_copy_moves_every_input_of_mixed_dtypes():
    sig = _static_copy(torch.zeros(3, 8, dtype=torch.bfloat16), _step([0, 1, 2], [5, 6, 7], [10, 11, 12]),
                       (torch.tensor([0, 2]),))
    x, step, rows = torch.randn(3, 8).bfloat16(), _step([2, 1, 3], [9, 6, 70000], [13, 2**40, 12]), torch.tensor([1, 0])
    _copy_in(sig, [x, *step.tensors(), rows])
    assert torch.equal(sig.x, x) and torch.equal(sig.extra[0], rows)
    for static, given in zip(sig.step.tensors(), step.tensors()):
        assert static.dtype == given.dtype and torch.equal(static, given)


def test_inputs_are_copied_as_the_widest_word_every_input_fits():
    """Eight rows: every input's bytes are a multiple of 8 (int64 words); one row: its int32 request
    tensors hold 4 bytes (int32 words); an input past one foreach chunk of bytes: bytes. A source
    whose storage offset is not a multiple of the word is copied as bytes, still in one launch."""
    rows = list(range(8))
    sig = _static_copy(torch.zeros(8, 8, dtype=torch.bfloat16), _step(rows, [5] * 8, rows), ())
    assert [t.dtype for t in sig.words] == [torch.int64] * 5
    one = _static_copy(torch.zeros(1, 8, dtype=torch.bfloat16), _step([0], [5], [10]), ())
    assert [t.dtype for t in one.words] == [torch.int32] * 5
    wide = _static_copy(torch.zeros(8, 8192, dtype=torch.bfloat16), _step(rows, [5] * 8, rows), ())  # 128 KB
    assert [t.dtype for t in wide.words] == [torch.uint8] * 5
    x = torch.randn(8 * 8 + 1).bfloat16()[1:].view(8, 8)  # 2 bytes into its storage: no int64 view
    step = _step([7, 6, 5, 4, 3, 2, 1, 0], [9] * 8, [2**40 + r for r in rows])
    _copy_in(sig, [x, *step.tensors()])
    assert torch.equal(sig.x, x)
    assert all(torch.equal(a, b) for a, b in zip(sig.step.tensors(), step.tensors()))


def test_inputs_that_cannot_be_viewed_as_bytes_are_copied_by_dtype():
    sig = _static_copy(torch.zeros(3, 8, dtype=torch.bfloat16), _step([0, 1, 2], [5, 6, 7], [10, 11, 12]), ())
    x = torch.randn(8, 3).bfloat16().t()  # last dim strided: no uint8 view
    step = _step([1, 1, 1], [2, 3, 4], [5, 6, 7])
    _copy_in(sig, [x, *step.tensors()])
    assert torch.equal(sig.x, x) and sig.x.is_contiguous()
    assert all(torch.equal(a, b) for a, b in zip(sig.step.tensors(), step.tensors()))


def test_static_copies_are_contiguous_and_keep_the_idle_form():
    """Without requests the three request tensors are one tensor (the compiled frames' idle form),
    and the copies own their memory: changing the caller's tensors afterwards changes nothing."""
    idle = StepInputs.idle(4)
    sig = _static_copy(torch.ones(4, 8, dtype=torch.bfloat16), idle, ())
    assert sig.step.seq_lens is sig.step.req_rows and sig.step.extend_lens is sig.step.req_rows
    idle.out_cache_loc.fill_(9)
    assert torch.equal(sig.step.out_cache_loc, torch.zeros(4, dtype=torch.int64))
    _copy_in(sig, [torch.full((4, 8), 2.0, dtype=torch.bfloat16), *StepInputs.idle(4).tensors()])
    assert torch.all(sig.x == 2)
