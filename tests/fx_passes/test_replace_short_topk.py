"""ReplaceShortTopkPass: an ``aten.topk`` of short rows whose values go unread becomes
``dsv4::topk_indices``, with the same columns.

Functions are compiled with Inductor and the pass, told to match CPU tensors (by default it
matches CUDA ones only, where the op is one launch). On the CPU the op is its reference (a stable
sort), so the columns equal ``torch.topk``'s sorted ones wherever the scores are distinct."""

import pytest
import torch

from dsv4_compile.compile import compile_step
from dsv4_compile.export import EXACT_NUMERICS
from dsv4_compile.fx_passes import DSV4PassManager, ReplaceShortTopkPass
from dsv4_compile.fx_passes.pass_manager import default_passes
from tests.support.compile_checks import fresh_compile_state
from tests.support.hf_model import three_layer_prefill

REPLACED = "dsv4.topk_indices.default"


def _compiled(fn, *args, devices=("cpu",)):
    """(matches, the graph's dsv4 ops, eager output, compiled output) of ``fn`` at ``args``."""
    replace = ReplaceShortTopkPass(devices)
    with torch.no_grad(), fresh_compile_state():
        got = torch.compile(fn, fullgraph=True, options={"post_grad_custom_post_pass": replace})(*args)
        want = fn(*args)
    return replace.matched_count, replace.last_ops, want, got


def _scores(rows=4, columns=256):
    return torch.randperm(rows * columns, generator=torch.Generator().manual_seed(columns)).view(rows, columns).float()


def _router(scores, bias):
    """transformers' learned router's choice (``DeepseekV4TopKRouter``)."""
    return torch.topk(scores + bias, 6, dim=-1, sorted=False).indices


@pytest.mark.parametrize("fn", [_router, lambda s, b: torch.topk(s * b, 3).indices,
                                lambda s, b: torch.topk(s, 2, dim=1, largest=True, sorted=True)[1]])
def test_topk_of_short_rows_replaced(fn):
    scores, bias = _scores(), torch.ones(256)
    matches, ops, want, got = _compiled(fn, scores, bias)
    assert (matches, ops) == (1, [REPLACED])
    assert torch.equal(got.sort(-1).values, want.sort(-1).values)  # the same columns; sorted=False: any order
    assert (scores.gather(1, got)[:, :-1] > scores.gather(1, got)[:, 1:]).all()  # descending


@pytest.mark.parametrize("case", ["values-read", "smallest", "long-rows", "other-dim", "cuda-only"])
def test_other_topks_left_alone(case):
    scores = _scores()
    fn, args, devices = {
        "values-read": (lambda s: torch.topk(s, 3), (scores,), ("cpu",)),
        "smallest": (lambda s: torch.topk(s, 3, largest=False).indices, (scores,), ("cpu",)),
        "long-rows": (lambda s: torch.topk(s, 3).indices, (_scores(2, 2048),), ("cpu",)),
        "other-dim": (lambda s: torch.topk(s, 3, dim=0).indices, (scores,), ("cpu",)),
        "cuda-only": (lambda s: torch.topk(s, 3).indices, (scores,), ("cuda",)),
    }[case]
    matches, ops, want, got = _compiled(fn, *args, devices=devices)
    assert (matches, ops) == (0, [])
    torch.testing.assert_close(got, want)


def test_uuid_follows_the_devices():
    assert ReplaceShortTopkPass(("cpu",)).uuid() != ReplaceShortTopkPass().uuid()


@pytest.mark.filterwarnings("ignore::UserWarning")  # transformers' MoE code under Dynamo
@torch.no_grad()
def test_model_step_replaces_each_learned_routers_topk():
    """compile_step of the 3-layer test model (a hash-routed MoE layer, then two learned ones) with
    the default passes and this one on the CPU: each learned router's top-k is replaced (the hash
    router has none), and the logits are the eager backend's, bit for bit (two experts a token:
    their sum does not depend on the order the router names them in)."""
    backend, ids, step = three_layer_prefill()
    want = backend(ids, step, torch.arange(6)).float()
    replace = ReplaceShortTopkPass(("cpu",))
    passes = [*default_passes(("cpu",)), replace]
    with fresh_compile_state():
        got = compile_step(backend, passes=DSV4PassManager(passes), options=EXACT_NUMERICS)(
            ids, step, torch.arange(6)).float()
    assert replace.matched_count == 2
    assert torch.equal(got, want)
