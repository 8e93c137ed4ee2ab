"""torch.export of a decode step with a dynamic batch dimension: the dsv4:: ops survive as
single nodes, the caches appear as mutated buffers, and the exported program reproduces eager
(outputs and cache contents) at several batch sizes."""

import torch
from torch.export import Dim, ShapesCollection

from dsv4_compile import DSV4AttnConfig, ForwardMode
from dsv4_compile.testing.oracle_recorder import make_engine

TINY = DSV4AttnConfig.from_name("tiny").with_(index_topk=64)


def _prefilled_engine():
    eng, rec = make_engine(TINY, max_requests=4, max_seq_len=512, capture_layers=False)
    rows = [eng.admit() for _ in range(4)]
    rec.run(ForwardMode.EXTEND, {r: 120 + 17 * i for i, r in enumerate(rows)})
    return eng, rec, rows


def _decode_step(exported, rec, eager, rows):
    """``(x, step)``: a decode step of ``rows`` built on ``exported`` with inputs drawn by ``rec``;
    ``eager`` allocates the same positions."""
    tokens = {r: 1 for r in rows}
    step = exported.build_step(ForwardMode.DECODE, tokens)
    eager.build_step(ForwardMode.DECODE, tokens)  # same allocation on both sides
    return exported.pack_inputs(step, rec.draw(tokens).values()), step


@torch.no_grad()
def test_export_decode_step_with_dynamic_batch():
    eager, _, rows = _prefilled_engine()
    exported, rec, _ = _prefilled_engine()
    x, step = _decode_step(exported, rec, eager, rows[:2])
    batch = Dim("batch", min=1, max=64)
    shapes = ShapesCollection()
    for t in (x, *step.tensors()):
        shapes[t] = {0: batch}
    ep = torch.export.export(exported.stack, (x, step), dynamic_shapes=shapes)

    ops = [str(n.target) for n in ep.graph.nodes if str(n.target).startswith("dsv4.")]
    assert ops.count("dsv4.sparse_attn.default") == 3 and ops[0] == "dsv4.expand_queries.default"
    mutated = set(ep.run_decompositions().graph_signature.buffers_to_mutate.values())
    assert {"cache.layers.0.swa_kv", "cache.layers.1.index_k", "cache.layers.2.kv_state"} <= mutated

    module = ep.module()
    want = eager.stack(x, step)
    got = module(x, step)
    assert torch.equal(got, want)
    for b in (3, 1, 4):  # other batch sizes through the same program
        x, step = _decode_step(exported, rec, eager, rows[:b])
        assert torch.equal(module(x, step), eager.stack(x, step))
    exported_cache = {k[len("cache."):]: v for k, v in module.state_dict().items() if k.startswith("cache.")}
    for name, value in eager.stack.cache.state_dict().items():
        assert torch.equal(exported_cache[name], value), name
