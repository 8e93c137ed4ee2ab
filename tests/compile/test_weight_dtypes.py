"""A compiled step reads its projection weights as stored: no bf16 weight matrix is converted to
another dtype inside the graph (a conversion would materialise a converted copy of the weight on
every step)."""

import torch

from dsv4_compile import DSV4AttnConfig, ForwardMode
from dsv4_compile.compile import compile_step
from dsv4_compile.fx_passes import DSV4PassManager
from dsv4_compile.fx_passes.base import DSV4InductorPass
from dsv4_compile.testing.oracle_recorder import make_engine
from tests.support.compile_checks import fresh_compile_state, graph_breaks
from tests.support.oracle_asserts import assert_outputs_match

TINY = DSV4AttnConfig.from_name("tiny").with_(index_topk=64, compress_ratios=(4, 128))
_CONVERSIONS = (torch.ops.prims.convert_element_type.default, torch.ops.aten._to_copy.default)


class WeightConversions(DSV4InductorPass):
    """Records, in each post-grad graph, the conversions of a graph input shaped like one of
    ``weights`` (2-D, static shape, same dtype: activations have a symbolic row count)."""

    def __init__(self, weights: list[torch.Tensor]):
        super().__init__()
        self.kinds = {(tuple(w.shape), w.dtype) for w in weights}
        self.found: list[str] = []

    def apply(self, graph: torch.fx.Graph) -> int:
        for node in graph.nodes:
            src = node.args[0] if node.op == "call_function" and node.target in _CONVERSIONS else None
            val = src.meta.get("val") if isinstance(src, torch.fx.Node) and src.op == "placeholder" else None
            if val is not None and val.dim() == 2 and all(isinstance(n, int) for n in val.shape) \
                    and (tuple(val.shape), val.dtype) in self.kinds:
                self.found.append(f"{node.format_node()} of {tuple(val.shape)} {val.dtype}")
        return 0


@torch.no_grad()
def test_compiled_compressed_layers_convert_no_weight():
    eng, rec = make_engine(TINY, max_requests=2, max_seq_len=256, capture_layers=False)
    weights = [p for p in eng.stack.parameters() if p.dim() == 2 and p.dtype == torch.bfloat16]
    assert any(w is layer.compressor.wkv for layer in eng.stack.layers for w in weights)
    recorder = WeightConversions(weights)
    row = eng.admit()
    with fresh_compile_state():
        eng.forward = compile_step(eng.stack, passes=DSV4PassManager([recorder]))
        for mode, n in ((ForwardMode.EXTEND, 9), (ForwardMode.DECODE, 1)):
            assert_outputs_match(rec, rec.run(mode, {row: n}))
        assert graph_breaks() == 0
    assert recorder.last_ops, "the recording pass did not run"
    assert recorder.found == []
