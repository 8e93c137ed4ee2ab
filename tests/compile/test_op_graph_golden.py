"""Golden list of the dsv4:: ops, in order, in the traced graph of a 2-layer decode step (ratios
4 and 128): a change in the op graph shows up in review. Refresh with EXPECTTEST_ACCEPT=1."""

import expecttest
import torch

from dsv4_compile import DSV4AttnConfig, ForwardMode
from dsv4_compile.testing.oracle_recorder import make_engine
from tests.support.compile_checks import GraphCapture, fresh_compile_state


class TestDecodeOpGraph(expecttest.TestCase):
    def test_two_layer_decode_op_sequence(self):
        cfg = DSV4AttnConfig.from_name("tiny").with_(compress_ratios=(4, 128), index_topk=64)
        eng, rec = make_engine(cfg, max_requests=2, max_seq_len=512, capture_layers=False)
        row = eng.admit()
        capture = GraphCapture("eager")
        with torch.no_grad(), fresh_compile_state():
            rec.run(ForwardMode.EXTEND, {row: 20})
            eng.forward = torch.compile(eng.stack, backend=capture, fullgraph=True)
            rec.run(ForwardMode.DECODE, {row: 1})
        self.assertEqual(capture.frame_count, 1)
        self.assertExpectedInline("\n".join(capture.dsv4_ops()), """\
dsv4.expand_queries
dsv4.build_page_table
dsv4.build_swa_metadata
dsv4.build_c4_metadata
dsv4.build_c128_metadata
dsv4.rms_norm
dsv4.rms_norm
dsv4.rope_tail
dsv4.rms_norm
dsv4.rope_tail
dsv4.store_kv
dsv4.compress_kv
dsv4.store_index_k
dsv4.indexer_prepare_q
dsv4.indexer_topk
dsv4.compress_kv
dsv4.store_kv
dsv4.sparse_attn
dsv4.grouped_linear
dsv4.rms_norm
dsv4.rms_norm
dsv4.rope_tail
dsv4.rms_norm
dsv4.rope_tail
dsv4.store_kv
dsv4.compress_kv
dsv4.store_kv
dsv4.sparse_attn
dsv4.grouped_linear""")


if __name__ == "__main__":
    expecttest.run_tests()
